import sys

from zmqworker.cli import main

sys.exit(main())
