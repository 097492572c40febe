import sys

from zmqworker.runtime.fast_exit import fast_exit
from zmqworker.runtime.main import main

# Everything the worker holds is closed on the way out of main() (WorkerServer.run's
# finally): the interpreter's finalization would only tear down torch's and Triton's C++
# state, slowly, and Triton's nanobind bindings report the objects left in it as leaks.
status = main()
sys.stdout.flush()
fast_exit([], status)
