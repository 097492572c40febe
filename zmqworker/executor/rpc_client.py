"""The engine side of the ROUTER socket: send a call to many ranks, match replies by id.

There is no I/O thread: a caller sends from its own thread, and whoever waits on a
result pumps the socket (one thread at a time), completing every call whose replies
arrive, not just its own. Worker deaths wake the same poll: MultiprocExecutor hands in
one pidfd per worker, so a SIGKILLed worker fails every pending call at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from messages import Decoder, Encoder, ProtocolError, RpcReply, RpcRequest
from zmqworker.executor.errors import (
    ExecutorError,
    RpcTimeoutError,
    WorkerDiedError,
    WorkerError,
)
from zmqworker.wake_pipe import WakePipe
from zmqworker.zmq_io import recv_frames, send_frames

log = logging.getLogger("zmqworker.executor")

# Plain ints: pyzmq's enum flags cost about 3 us a use here.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
POLL_SLICE_S = 0.1  # the longest a pump sleeps before it looks at deadlines and deaths again
STEP_ASIDE_S = 50e-6  # how a pump waits, lock released, while another thread sends


class Liveness:
    """How the client learns that a worker died. fds: file descriptors that become
    readable when the worker of that rank dies; check(): a death found by looking."""

    fds: dict[int, int] = {}

    def check(self) -> WorkerDiedError | None:
        return None


class RpcFuture(Future):
    """A call's result, for callers that do not wait at once. Waiting on it pumps the
    socket."""

    def __init__(self, client: RpcClient, call: _Call) -> None:
        super().__init__()
        self._client = client
        self._call = call

    def result(self, timeout: float | None = None) -> Any:
        self._client.wait_for(self._call.is_done, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._client.wait_for(self._call.is_done, timeout)
        return super().exception(timeout=0)

    def cancel(self) -> bool:
        """A call already sent runs on its workers: it cannot be cancelled."""
        return False


@dataclass
class _Call:
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

    def is_done(self) -> bool:
        return self.done

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        # The future first: a thread that sees done reads the future's result at once.
        if self.future is not None and error is not None:
            self.future.set_exception(error)
        elif self.future is not None:
            self.future.set_result(value)
        self.value, self.error, self.done = value, error, True


class RpcClient:
    def __init__(
        self,
        sock: zmq.Socket,
        liveness: Liveness,
        on_other: Callable[[bytes, Any], None] | None = None,
    ) -> None:
        self.sock = sock
        self.liveness = liveness
        self.on_other = on_other  # messages that are not replies (the handshake's Hellos)
        self.identities: dict[int, bytes] = {}  # rank -> ROUTER identity
        self.dropped_messages = 0
        self.late_replies = 0
        self._enc = Encoder()
        self._dec = Decoder()
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._lock = threading.RLock()
        self._progress = threading.Condition(threading.Lock())  # a call finished
        self._bystanders = 0  # threads waiting on _progress
        self._dead: ExecutorError | None = None
        # Threads that want the lock while another pumps (_turn): they write to the pipe,
        # which the pump's poll watches, so that it steps aside at once.
        self._turn_lock = threading.Lock()
        self._wanting = 0
        self._polling = False
        self._wakes = WakePipe()
        self._poller = zmq.Poller()
        self._poller.register(sock, _POLLIN)
        self._poller.register(self._wakes.fd, _POLLIN)
        for fd in liveness.fds:
            self._poller.register(fd, _POLLIN)

    @property
    def dead(self) -> ExecutorError | None:
        return self._dead

    def call(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        reply_rank: int | None = None,
    ) -> RpcFuture:
        """Send method to ranks (default: all that said hello); reply_rank: only that rank
        answers, and the future's result is its result rather than a list."""
        return self._start(method, args, kwargs, ranks, timeout, reply_rank, True).future

    def call_and_wait(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        reply_rank: int | None = None,
    ) -> Any:
        """call(...).result(), without a future: the path of every blocking step."""
        call = self._start(method, args, kwargs, ranks, timeout, reply_rank, False)
        self.wait_for(call.is_done)
        if call.error is not None:
            raise call.error
        return call.value

    def _start(
        self,
        method: str,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        ranks: Iterable[int] | None,
        timeout: float | None,
        reply_rank: int | None,
        with_future: bool,
    ) -> _Call:
        ranks = sorted(self.identities if ranks is None else ranks)
        if reply_rank is not None and reply_rank not in ranks:
            raise ValueError(f"unique_reply_rank {reply_rank} is not one of the ranks {ranks}")
        with self._turn():
            self._check_alive()
            call_id = next(self._ids)
            deadline = None if timeout is None else time.monotonic() + timeout
            req = RpcRequest(
                call_id=call_id,
                method=method,
                args=list(args),
                kwargs=kwargs or {},
                deadline=0.0 if timeout is None else time.time() + timeout,
                reply_rank=reply_rank,
            )
            try:
                frames = self._enc.encode(req)
            except (TypeError, ValueError) as e:
                raise TypeError(f"arguments of {method} cannot be encoded: {e}") from None
            waiting = {reply_rank} if reply_rank is not None else set(ranks)
            call = self._calls[call_id] = _Call(method, waiting, reply_rank, timeout, deadline)
            if with_future:
                call.future = RpcFuture(self, call)
            for rank in ranks:
                try:
                    send_frames(self.sock, [self.identities[rank], *frames])
                except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
                    self._fail_all(self.liveness.check() or WorkerDiedError(rank, None, f" ({e})"))
                    break
            return call

    def send_to(self, rank: int, msg: Any) -> None:
        """Send a message that is not a call (the handshake's Welcome) to one rank."""
        with self._turn():
            send_frames(self.sock, [self.identities[rank], *self._enc.encode(msg)])

    def wait_for(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Pump until done() is true; TimeoutError after timeout seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while not done():
            if self._lock.acquire(timeout=0.001):
                try:
                    while not done() and not self._wanting:
                        left = None if end is None else end - time.monotonic()
                        if left is not None and left <= 0:
                            raise TimeoutError(f"not done within {timeout} s")
                        self._pump(POLL_SLICE_S if left is None else min(left, POLL_SLICE_S))
                finally:
                    self._lock.release()
                while self._wanting and not done():  # let the short jobs have the lock
                    time.sleep(STEP_ASIDE_S)
            else:  # another thread pumps: wait for it to finish a call
                if end is not None and time.monotonic() >= end:
                    raise TimeoutError(f"not done within {timeout} s")
                with self._progress:
                    self._bystanders += 1
                    self._progress.wait(0.005)
                    self._bystanders -= 1

    def close(self) -> None:
        """Release the client's own file descriptors (the socket is its owner's)."""
        with self._lock:
            self._poller.unregister(self._wakes.fd)
            self._wakes.close()

    def fail_all(self, error: ExecutorError) -> None:
        with self._turn():
            self._fail_all(error)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The lock, for a short job (a send, fail_all). A thread that pumps holds the lock
        for as long as it waits: it is woken, and steps aside until the job is done."""
        with self._turn_lock:
            self._wanting += 1
        if self._polling:
            self._wakes.wake()
        try:
            with self._lock:
                yield
        finally:
            with self._turn_lock:
                self._wanting -= 1

    # internals ------------------------------------------------------------------------

    def _pump(self, max_wait_s: float) -> None:
        next_deadline = min((c.deadline for c in self._calls.values() if c.deadline), default=None)
        if next_deadline is not None:
            max_wait_s = max(0.0, min(max_wait_s, next_deadline - time.monotonic()))
        self._polling = True
        try:
            events = dict(self._poller.poll(max_wait_s * 1000))
        finally:
            self._polling = False
        if events.pop(self._wakes.fd, 0):
            self._wakes.drain()
        if events.pop(self.sock, 0):
            self._receive()
            # More replies of a call still open (several ranks) are likely there already:
            # looking costs less than another poll.
            while self._calls and self.sock.getsockopt(_EVENTS) & _POLLIN:
                self._receive()
        if events:  # a pidfd: that worker is gone
            rank = self.liveness.fds[next(iter(events))]
            self._fail_all(self.liveness.check() or WorkerDiedError(rank, None))
        elif not self.liveness.fds and self._calls:  # nothing to wake us: look
            died = self.liveness.check()
            if died is not None:
                self._fail_all(died)
        if next_deadline is not None:
            self._expire(time.monotonic())

    def _receive(self) -> None:
        """Handle the message that poll found. One only: a caller whose call it completes
        returns without asking zmq for more, and the next poll finds any others at once."""
        try:
            frames = recv_frames(self.sock)
        except zmq.Again:
            return
        identity = frames[0].bytes
        try:
            msg = self._dec.decode(frames[1:])
        except ProtocolError as e:
            self.dropped_messages += 1
            log.warning("dropped a message that did not decode (peer %r): %s", identity, e)
            return
        if isinstance(msg, RpcReply) and self.identities.get(msg.rank) == identity:
            self._on_reply(msg)
        elif self.on_other is not None:
            self.on_other(identity, msg)
        else:
            self.dropped_messages += 1
            log.warning("dropped an unexpected %s (peer %r)", type(msg).__name__, identity)

    def _on_reply(self, reply: RpcReply) -> None:
        call = self._calls.get(reply.call_id)
        if call is None:
            if reply.error is not None and reply.call_id < 0:
                log.warning(
                    "rank %d could not decode a message: %s", reply.rank, reply.error.message
                )
            self.late_replies += 1
            return
        if reply.error is not None:
            del self._calls[reply.call_id]
            self._finish(call, error=WorkerError(call.method, reply.error))
            return
        if reply.rank not in call.waiting_for:
            self.late_replies += 1
            return
        call.results[reply.rank] = reply.result
        call.waiting_for.discard(reply.rank)
        if not call.waiting_for:
            del self._calls[reply.call_id]
            if call.single_rank is not None:
                self._finish(call, call.results[call.single_rank])
            else:
                self._finish(call, [call.results[r] for r in sorted(call.results)])

    def _expire(self, now: float) -> None:
        for call_id, call in list(self._calls.items()):
            if call.deadline is not None and now >= call.deadline:
                del self._calls[call_id]
                error = RpcTimeoutError(call.method, sorted(call.waiting_for), call.timeout or 0.0)
                self._finish(call, error=error)

    def _check_alive(self) -> None:
        # Deaths wake the pump through the pidfds; only without them do we look here.
        if self._dead is None and not self.liveness.fds:
            died = self.liveness.check()
            if died is not None:
                self._fail_all(died)
        if self._dead is not None:
            raise self._dead

    def _fail_all(self, error: ExecutorError) -> None:
        if self._dead is None:
            self._dead = error
        calls, self._calls = self._calls, {}
        for call in calls.values():
            self._finish(call, error=error)

    def _finish(self, call: _Call, value: Any = None, error: BaseException | None = None) -> None:
        call.finish(value, error)
        if self._bystanders:  # threads waiting while this one pumps
            with self._progress:
                self._progress.notify_all()
