"""The scheduler's waiting requests, in the order they are tried: first those whose KV
came from a prefill instance (they hold their blocks already, and behind a request that
does not fit they would wait for blocks that only their own run gives back), then
preempted requests (they started before the rest), then new ones in arrival order.

With nothing running, and no finished request's blocks to come back from a step in
flight (a step in flight may compute nothing: one that only carries KV orders), no block
is ever freed for a request that does not fit: the scheduler then takes the blocks of the
newest other loaded request (unload), which computes its prompt itself, as a preempted
request does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.request import Request, RequestStatus


def _loaded(request: Request) -> bool:
    """Whether request holds the blocks of KV loaded from a prefill instance."""
    return request.num_loaded_tokens > 0


class WaitingQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        """The request to try index-th (0: first)."""
        return self._queue[index]

    def add_new(self, request: Request) -> None:
        self._queue.append(request)

    def add_loaded(self, request: Request) -> None:
        """A request whose KV has come: first, with the others that hold theirs."""
        self._queue.appendleft(request)

    def preempt(self, request: Request, kv: KVBlockManager) -> None:
        """request (running, or loaded) gives its blocks back and waits to start over,
        behind the loaded requests and ahead of the rest."""
        kv.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_loaded_tokens = 0
        request.num_preemptions += 1
        self._queue.insert(self._num_loaded(), request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def clear(self) -> None:
        self._queue.clear()

    def unload(self, other_than: Request, kv: KVBlockManager) -> bool:
        """The loaded request that came last, other than other_than, gives its blocks
        back and waits as a preempted request, to compute its prompt itself; whether
        there was one."""
        for request in self._queue:
            if _loaded(request) and request is not other_than:
                self._queue.remove(request)
                self.preempt(request, kv)
                return True
        return False

    def _num_loaded(self) -> int:
        count = 0
        while count < len(self._queue) and _loaded(self._queue[count]):
            count += 1
        return count
