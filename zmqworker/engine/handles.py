"""Request handles: small non-negative int32s that name requests on the hot path.

A handle is reused only after every step that could still name it has come back: the
step that told the workers to drop it, and so every step before it.
"""

from __future__ import annotations

import heapq

INT32_MAX = 2**31 - 1


class HandlePool:
    """Hands out the smallest free handle, so workers can index arrays by it."""

    def __init__(self) -> None:
        self._free: list[int] = []  # a heap
        self._next = 0
        self._live: set[int] = set()

    def acquire(self) -> int:
        if self._free:
            handle = heapq.heappop(self._free)
        elif self._next > INT32_MAX:
            raise RuntimeError("out of request handles: over 2**31 requests live at once")
        else:
            handle = self._next
            self._next += 1
        self._live.add(handle)
        return handle

    def live_handles(self) -> list[int]:
        return sorted(self._live)

    def release(self, handles: list[int]) -> None:
        """Return handles whose drop the workers have seen (their step came back)."""
        for handle in handles:
            if handle not in self._live:
                raise RuntimeError(f"handle {handle} released but not live")
            self._live.remove(handle)
            heapq.heappush(self._free, handle)
