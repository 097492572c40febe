"""What the RpcClient keeps of a call in flight and of the answers still owed after a
timeout, and how a worker's death is learnt; a call's request and frames, and the call a
reply that did not decode names."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import zmq

from messages import Encoder, ProtocolError, RpcRequest
from messages.codec import peek_call_id
from messages.rpc import CONCURRENT_METHODS
from zmqworker.executor.errors import UndecodableReplyError, WorkerDiedError, timed_out
from zmqworker.executor.message_limits import check_request_frames
from zmqworker.transport.frames import TooManyFrames

if TYPE_CHECKING:
    from collections.abc import Mapping


class Liveness:
    """How the client learns that a worker died: fds that become readable when the
    worker of that rank dies (watched by a thread that wakes the client), and check(), a
    death found by looking; and how it ends a worker that no longer serves (kill). The
    base class knows of no deaths and kills nothing."""

    def __init__(self, fds: Mapping[int, int] | None = None) -> None:
        self.fds: dict[int, int] = dict(fds or {})  # fd -> rank

    def check(self) -> WorkerDiedError | None:
        return None

    def kill(self, rank: int) -> None:
        """End rank's worker for good (it is stuck)."""

    def stopped(self, rank: int) -> bool:
        """Whether rank's process is stopped (SIGSTOP): it answers nothing, heartbeats
        included, until continued. False where that cannot be seen."""
        return False

    def exit_status(self, rank: int) -> int | None:
        """rank's exit status once its process has exited; None while it runs, or where
        that cannot be seen."""
        return None


class RpcFuture(Future):
    """A call's result, for callers that do not wait at once. Waiting on it receives
    replies (wait_for), since no thread of the client does that by itself."""

    def __init__(
        self,
        wait_for: Callable[[Callable[[], bool], float | None], None],
        is_done: Callable[[], bool],
    ) -> None:
        super().__init__()
        self._wait_for = wait_for
        self._is_done = is_done

    def result(self, timeout: float | None = None) -> Any:
        self._wait_for(self._is_done, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait_for(self._is_done, timeout)
        return super().exception(timeout=0)

    def cancel(self) -> bool:
        """A call already sent runs on its workers: it cannot be cancelled."""
        return False


@dataclass(slots=True)
class Call:
    """One call in flight. A blocking caller reads done/value/error directly: a
    concurrent.futures.Future costs a Condition per call and a lock per look at it."""

    method: str
    waiting_for: set[int]
    single_rank: int | None
    timeout: float | None
    deadline: float | None  # time.monotonic()
    results: dict[int, Any] = field(default_factory=dict)
    future: RpcFuture | None = None
    done: bool = False
    value: Any = None
    error: BaseException | None = None

    @property
    def is_done(self) -> Callable[[], bool]:
        """A test of done for wait_for, run after every reply: a C-level callable, since
        a method here costs a Python frame each time."""
        return partial(getattr, self, "done")

    def add_result(self, rank: int, result: Any) -> bool:
        """rank's result; True once no rank is waited for (then finish_with_results)."""
        self.results[rank] = result
        self.waiting_for.discard(rank)
        return not self.waiting_for

    def finish_with_results(self) -> None:
        """Finish with the results by rank, or single_rank's alone."""
        results = self.results
        if self.single_rank is not None:
            self.finish(results[self.single_rank])
        else:
            self.finish([results[r] for r in sorted(results)])

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        # The fields first: a thread that sees the future done reads them at once.
        self.value, self.error, self.done = value, error, True
        if self.future is not None and error is not None:
            self.future.set_exception(error)
        elif self.future is not None:
            self.future.set_result(value)


class OwedAnswers:
    """The ranks that never answered a call that timed out (one that runs in order with
    the others, not beside them): each is busy with it, or wedged, until it answers that
    call or a later one, since a rank runs them in order. The newest such call is kept
    per rank. Of a step (unique_reply_rank), only the ranks it waits for are known to owe."""

    def __init__(self) -> None:
        self._by_rank: dict[int, int] = {}  # rank -> call id

    @property
    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    def timed_out(self, call_id: int, call: Call) -> None:
        if call.method not in CONCURRENT_METHODS:
            self._by_rank.update(dict.fromkeys(call.waiting_for, call_id))

    def answered(self, rank: int, call_id: int, call: Call | None) -> None:
        """rank answered call_id (call: the call if still open, else None)."""
        owed = self._by_rank.get(rank)
        if owed is not None and (
            call_id == owed
            or (call_id > owed and call is not None and call.method not in CONCURRENT_METHODS)
        ):
            del self._by_rank[rank]

    def clear(self) -> None:
        self._by_rank.clear()


def new_request(
    call_id: int,
    method: str,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    timeout: float | None,
    reply_rank: int | list[int] | None,
) -> RpcRequest:
    """A call's request (its deadline timeout seconds from now); a TypeError where an
    argument is not a Value."""
    deadline = 0.0 if timeout is None else time.time() + timeout
    try:
        return RpcRequest(call_id, method, list(args), kwargs or {}, deadline, reply_rank)
    except ValueError as e:
        raise TypeError(f"arguments of {method} cannot be encoded: {e}") from None


def fail_undecoded(
    error: ProtocolError,
    identity: bytes,
    frames: list[zmq.Frame] | TooManyFrames,
    identities: dict[int, bytes],
    calls: dict[int, Call],
    owed: OwedAnswers,
) -> None:
    """A message from identity that did not decode (error): where it is a worker's and its
    frame 0 names a call in calls (messages.codec.peek_call_id), that call fails now,
    rather than at its deadline or never."""
    rank = next((r for r, i in identities.items() if i == identity), None)
    first = frames.first if isinstance(frames, TooManyFrames) else frames[0]
    call_id = None if rank is None else peek_call_id(first.buffer)
    call = None if call_id is None else calls.pop(call_id, None)
    if call is not None:
        owed.answered(rank, call_id, call)
        call.finish(error=UndecodableReplyError(call.method, rank, str(error)))


def expire(calls: dict[int, Call], owed: OwedAnswers, now: float) -> None:
    """Fail the calls of calls whose deadline has passed: their ranks owe the answer."""
    for call_id, call in list(calls.items()):
        if call.deadline is not None and now >= call.deadline:
            del calls[call_id]
            owed.timed_out(call_id, call)
            call.finish(error=timed_out(call.method, sorted(call.waiting_for), call.timeout or 0.0))


def receive_wait_ms(calls: dict[int, Call], caller_left: float | None, slice_s: float) -> int:
    """How long the next receive may wait: the caller's time left, the calls' earliest
    deadline and slice_s, whichever comes first."""
    wait_s = slice_s if caller_left is None else min(caller_left, slice_s)
    deadline = min((c.deadline for c in calls.values() if c.deadline), default=None)
    if deadline is not None:
        wait_s = min(wait_s, deadline - time.monotonic())
    return max(0, math.ceil(wait_s * 1000))


def request_frames(enc: Encoder, req: RpcRequest, limit: int | None) -> list[bytes | memoryview]:
    """req's frames to send; refused here, before anything is sent, where its arguments
    cannot be encoded (TypeError) or a worker would drop it (ValueError; limit: the
    workers' largest frame, None for no bound)."""
    try:
        frames = enc.encode(req)
    except (TypeError, ValueError) as e:
        raise TypeError(f"arguments of {req.method} cannot be encoded: {e}") from None
    if limit is not None:
        check_request_frames(req.method, frames, limit)
    return frames
