"""Leaving at once: when the engine is gone (or SIGTERM says so), a worker must not stay
behind for a step it is in the middle of.

The interpreter's own exit would join threads and run finalizers, and a compute thread in
the middle of a large step holds the process for seconds. os._exit skips all of that, so
what must not be left behind goes first: the ipc socket files (the engine's, when it was
killed and cannot remove it, and this worker's pipeline receiver), and the socket folders
this process made and still holds (an engine core's executor's, which its workers remove
when it dies, but which it holds alone before they start). Shared memory needs
nothing: the pipeline's segments are anonymous (memfd), freed by the kernel with the
process.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterable
from typing import NoReturn

from zmqworker.runtime.sockets import remove_socket_file

_held_folders: set[str] = set()  # this process's socket folders, until it removes them


def hold_folder(folder: str) -> None:
    """A socket folder this process made: fast_exit removes it, unless let_go first."""
    _held_folders.add(folder)


def let_go(folder: str) -> None:
    """The folder is removed (or another process's to remove) from now on."""
    _held_folders.discard(folder)


def fast_exit(addresses: Iterable[str], status: int = 0) -> NoReturn:
    """Remove the ipc socket files of addresses (and their folder once empty) and the
    folders held here, flush what was logged, and end the process."""
    for address in addresses:
        remove_socket_file(address)
    for folder in list(_held_folders):
        shutil.rmtree(folder, ignore_errors=True)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(status)
