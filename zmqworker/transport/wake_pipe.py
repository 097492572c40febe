"""A pipe that one thread writes to wake another out of a poll (poll its fd)."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()  # no write after close: the fd number may be reused
        self._close_fds = weakref.finalize(self, _close, self.fd, self._write_fd)

    def wake(self) -> None:
        with self._lock:
            if not self._close_fds.alive:
                return
            with contextlib.suppress(BlockingIOError):  # full of wake-ups: one is enough
                os.write(self._write_fd, b"\0")

    def drain(self) -> None:
        """Read every wake-up so far (from the thread that polls fd)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                continue

    def close(self) -> None:
        with self._lock:
            self._close_fds()


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)
