"""Device copies out of producers' GPU caches, queued on the worker's thread and watched on
the puller's: what must wait for a copy (letting a producer's cache or an answer go,
telling the producer its KV was taken) follows once the copy has run, and the worker's
thread never waits behind the steps queued before it."""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch


class CopiesRun:
    def __init__(self) -> None:
        self._new: queue.SimpleQueue[tuple[torch.cuda.Event, Callable[[], None]]] = (
            queue.SimpleQueue()
        )
        self._running: list[tuple[torch.cuda.Event, Callable[[], None]]] = []  # the watcher's

    def add(self, copied: torch.cuda.Event, then: Callable[[], None]) -> None:
        """then() once copied has passed (from any thread)."""
        self._new.put((copied, then))

    @property
    def watched(self) -> bool:
        """Whether copies are under way (the watcher's thread)."""
        return bool(self._running)

    def poll(self) -> None:
        """Call then() for each copy that has run (the watcher's thread); each once, even
        where one raises."""
        self._take()
        ran: list[tuple[torch.cuda.Event, Callable[[], None]]] = []
        running: list[tuple[torch.cuda.Event, Callable[[], None]]] = []
        for entry in self._running:
            (ran if entry[0].query() else running).append(entry)
        self._running = running
        for _, then in ran:
            then()

    def close(self) -> None:
        """Wait for every copy and call its then() (the watcher has stopped)."""
        self._take()
        running, self._running = self._running, []
        for copied, then in running:
            copied.synchronize()
            then()

    def _take(self) -> None:
        while True:
            try:
                self._running.append(self._new.get_nowait())
            except queue.Empty:
                return
