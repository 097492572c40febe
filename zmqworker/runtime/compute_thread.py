"""The thread that runs model work, in arrival order, off the event loop.

Lighter than ThreadPoolExecutor + run_in_executor: one queue, one thread, and the
completion handled on this thread (the reply is sent from here), so a call costs one
thread hop, not two. This hop is on every step's round trip.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

Done = Callable[[Any, BaseException | None], None]


class ComputeThread:
    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Done] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        """Run fn, then done(result, error), both on the compute thread."""
        self._queue.put((fn, done))

    def stop(self) -> None:
        """Finish the queued work, then end the thread (does not wait for it)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, done = item
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to done, which replies with it
                result, error = None, e
            done(result, error)
