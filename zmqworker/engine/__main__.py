"""python -m zmqworker.engine: the engine core process (core_main.py)."""

import sys

from zmqworker.engine.core_main import main

sys.exit(main())
