import sys

from zmqworker.runtime.main import main

sys.exit(main())
