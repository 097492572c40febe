"""Leaving at once: when the engine is gone (or SIGTERM says so), a worker must not stay
behind for a step it is in the middle of.

The interpreter's own exit would join threads and run finalizers, and a compute thread in
the middle of a large step holds the process for seconds. os._exit skips all of that, so
what must not be left behind goes first: the ipc socket files (the engine's, when it was
killed and cannot remove it, and this worker's pipeline receiver). Shared memory needs
nothing: the pipeline's segments are anonymous (memfd), freed by the kernel with the
process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import NoReturn

from zmqworker.runtime.sockets import remove_socket_file


def fast_exit(addresses: Iterable[str], status: int = 0) -> NoReturn:
    """Remove the ipc socket files of addresses (and their folder once empty), flush
    what was logged, and end the process."""
    for address in addresses:
        remove_socket_file(address)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)
