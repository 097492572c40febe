"""The engine side of the ROUTER socket: send a call to many ranks, match replies by id.

There is no I/O thread: a caller sends from its own thread, and whoever waits on a
result pumps the socket (one thread at a time) in a blocking receive, completing every
call whose replies arrive, not just its own. Worker deaths wake the same receive
(nudge.py): MultiprocExecutor hands in one pidfd per worker, so a SIGKILLed worker fails
every pending call at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq

from messages import Decoder, Encoder, ProtocolError, RpcReply, RpcRequest
from zmqworker.executor.errors import (
    ExecutorError,
    RpcTimeoutError,
    WorkerDiedError,
    WorkerError,
    WorkerStuckError,
)
from zmqworker.executor.nudge import NUDGE_IDENTITY, Nudger
from zmqworker.zmq_io import recv_frames, send_frames

log = logging.getLogger("zmqworker.executor")

SEND_TIMEOUT_S = 10.0  # how long a send waits on a live worker that reads nothing
POLL_SLICE_S = 0.1  # the longest a pump waits before it looks at deadlines again
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


@dataclass(slots=True)
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

    @property
    def is_done(self) -> Callable[[], bool]:
        """A test of done for wait_for, which runs it after every reply: a C-level
        callable, since a method here costs a Python frame each time."""
        return partial(getattr, self, "done")

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
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        """send_timeout_s: how long a send may wait for a worker that is alive but
        leaves its messages unread once the queue to it is full (the socket's SNDTIMEO)."""
        self.sock = sock
        self.liveness = liveness
        self.on_other = on_other  # messages that are not replies (the handshake's Hellos)
        self.identities: dict[int, bytes] = {}  # rank -> ROUTER identity (add_peer)
        self._all_ranks: list[int] = []  # sorted(identities)
        self.dropped_messages = 0
        self.late_replies = 0
        self._enc = Encoder()
        self._dec = Decoder()
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._timed = 0  # calls in _calls with a deadline
        # The earliest of their deadlines, or earlier (a call that had it may be over):
        # set as a pump starts, lowered by a call started meanwhile (from a future's
        # done-callback, which runs on the pumping thread).
        self._next_deadline: float | None = None
        self._lock = threading.RLock()
        self._progress = threading.Condition(threading.Lock())  # a call finished
        self._bystanders = 0  # threads waiting on _progress
        self._dead: ExecutorError | None = None
        # Threads that want the lock while another pumps (_take_turn) nudge it out of
        # its receive, so that it steps aside at once; so does a worker's death.
        self._turn_lock = threading.Lock()
        self._wanting = 0
        self._polling = False
        self._deaths: list[int] = []  # ranks whose death signal fired, in order
        self._rcvtimeo_ms = -1
        self._nudger = Nudger(sock, liveness.fds, self._deaths.append)
        self.send_timeout_s = send_timeout_s

    @property
    def dead(self) -> ExecutorError | None:
        return self._dead

    @property
    def send_timeout_s(self) -> float:
        return self._send_timeout_s

    @send_timeout_s.setter
    def send_timeout_s(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {seconds!r}")
        self._take_turn()  # the socket may be in another thread's receive
        try:
            self.sock.setsockopt(zmq.SNDTIMEO, max(1, round(seconds * 1000)))
            self._send_timeout_s = seconds
        finally:
            self._release_turn()

    def add_peer(self, rank: int, identity: bytes) -> None:
        """rank answers from the ROUTER identity identity (it said hello)."""
        with self._lock:
            self.identities[rank] = identity
            self._all_ranks = sorted(self.identities)

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
        ranks = self._all_ranks if ranks is None else sorted(ranks)
        if reply_rank is not None and reply_rank not in ranks:
            raise ValueError(f"unique_reply_rank {reply_rank} is not one of the ranks {ranks}")
        self._take_turn()
        try:
            self._check_alive()
            call_id = next(self._ids)
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
            deadline = None
            if timeout is not None:
                deadline = time.monotonic() + timeout
                self._timed += 1
                if self._next_deadline is None or deadline < self._next_deadline:
                    self._next_deadline = deadline
            call = self._calls[call_id] = _Call(method, waiting, reply_rank, timeout, deadline)
            if with_future:
                call.future = RpcFuture(self, call)
            identities = self.identities
            for rank in ranks:
                try:  # a ROUTER sends to the peer whose identity leads the message
                    send_frames(self.sock, (identities[rank], *frames))
                except zmq.Again:  # SNDTIMEO: that rank has not read its messages
                    error = WorkerStuckError(rank, method, self.send_timeout_s)
                    if rank != ranks[0]:  # the ranks before it run the call: out of step
                        self._fail_all(error)
                        break
                    self._forget(call_id)
                    self._finish(call, error=error)
                    break
                except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
                    self._fail_all(self.liveness.check() or WorkerDiedError(rank, None, f" ({e})"))
                    break
            return call
        finally:
            self._release_turn()

    def send_to(self, rank: int, msg: Any) -> None:
        """Send a message that is not a call (the handshake's Welcome) to one rank."""
        self._take_turn()
        try:
            send_frames(self.sock, (self.identities[rank], *self._enc.encode(msg)))
        finally:
            self._release_turn()

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
                        wait_s = POLL_SLICE_S if left is None else min(left, POLL_SLICE_S)
                        self._pump(done, wait_s, bounded=end is not None)
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

    def close(self, why: str = "the executor is shut down") -> None:
        """Fail the calls still open (a thread waiting on one leaves the ROUTER's
        receive), stop watching the liveness fds (close this before them), and release
        the client's own socket and fds (the ROUTER is its owner's)."""
        self.fail_all(ExecutorError(why))
        self._nudger.close()

    def fail_all(self, error: ExecutorError) -> None:
        self._take_turn()
        try:
            self._fail_all(error)
        finally:
            self._release_turn()

    def _take_turn(self) -> None:
        """The lock, for a short job (a send, fail_all): a thread that pumps holds it for
        as long as it waits, so it is woken and steps aside until _release_turn()."""
        if self._lock.acquire(blocking=False):  # nobody pumps: the common case
            return
        with self._turn_lock:
            self._wanting += 1
        try:
            if self._polling:
                self._nudger.nudge()
            self._lock.acquire()
        finally:
            with self._turn_lock:
                self._wanting -= 1

    def _release_turn(self) -> None:
        self._lock.release()

    # internals ------------------------------------------------------------------------

    def _pump(self, done: Callable[[], bool], max_wait_s: float, bounded: bool) -> None:
        """Receive and handle messages until done(), a death, a thread that wants the
        lock, or max_wait_s (at most until the next deadline) without one. bounded: the
        caller has a time limit of its own, to look at after every message (the receive's
        timeout starts again with each one)."""
        self._next_deadline = None
        if self._timed:
            self._next_deadline = min(
                c.deadline for c in self._calls.values() if c.deadline is not None
            )
            max_wait_s = min(max_wait_s, self._next_deadline - time.monotonic())
        wait_ms = max(0, math.ceil(max_wait_s * 1000))
        if wait_ms != self._rcvtimeo_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._rcvtimeo_ms = wait_ms
        recv = self.sock.recv
        signalled = bool(self.liveness.fds)
        while True:
            self._polling = True  # set before _wanting is read: see _take_turn
            try:
                if self._wanting:
                    break
                identity = recv()  # blocks until a message, or RCVTIMEO
            except zmq.Again:
                break
            finally:
                self._polling = False
            self._handle(identity)
            # Straight on to the next reply, unless something needs a look first.
            if done() or bounded or self._deaths or not signalled:
                break
            # Each reply restarts the receive's timeout: leave while another wait could
            # run past the earliest deadline, so that the next pump waits less.
            deadline = self._next_deadline
            if deadline is not None and time.monotonic() + wait_ms / 1000 >= deadline:
                break
        died = None
        if self._deaths:
            died = self.liveness.check() or WorkerDiedError(self._deaths[0], None)
        elif not signalled and self._calls:  # nothing signals deaths: look
            died = self.liveness.check()
        if died is not None:
            self._fail_all(died)
        if self._next_deadline is not None:
            now = time.monotonic()
            if now >= self._next_deadline:
                self._expire(now)

    def _handle(self, identity: bytes) -> None:
        """The rest of the message whose first frame (the peer's identity) came in."""
        frames = recv_frames(self.sock)  # the rest of a message is there with its first frame
        if identity == NUDGE_IDENTITY:
            return
        try:
            msg = self._dec.decode(frames)
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
        elif reply.error is not None:
            self._forget(reply.call_id)
            self._finish(call, error=WorkerError(call.method, reply.error))
        elif reply.rank not in call.waiting_for:
            self.late_replies += 1
        else:
            call.results[reply.rank] = reply.result
            call.waiting_for.discard(reply.rank)
            if call.waiting_for:
                return
            self._forget(reply.call_id)
            results = call.results
            if call.single_rank is not None:
                self._finish(call, results[call.single_rank])
            else:
                self._finish(call, [results[r] for r in sorted(results)])

    def _expire(self, now: float) -> None:
        for call_id, call in list(self._calls.items()):
            if call.deadline is not None and now >= call.deadline:
                self._forget(call_id)
                error = RpcTimeoutError(call.method, sorted(call.waiting_for), call.timeout or 0.0)
                self._finish(call, error=error)

    def _forget(self, call_id: int) -> None:
        if self._calls.pop(call_id).deadline is not None:
            self._timed -= 1

    def _check_alive(self) -> None:
        # Deaths signalled while nobody pumped; without signals, look.
        if self._dead is None and (self._deaths or not self.liveness.fds):
            died = self.liveness.check()
            if died is None and self._deaths:
                died = WorkerDiedError(self._deaths[0], None)
            if died is not None:
                self._fail_all(died)
        if self._dead is not None:
            raise self._dead

    def _fail_all(self, error: ExecutorError) -> None:
        if self._dead is None:
            self._dead = error
        calls, self._calls, self._timed, self._next_deadline = self._calls, {}, 0, None
        for call in calls.values():
            self._finish(call, error=error)

    def _finish(self, call: _Call, value: Any = None, error: BaseException | None = None) -> None:
        call.finish(value, error)
        if self._bystanders:  # threads waiting while this one pumps
            with self._progress:
                self._progress.notify_all()
