"""The engine side of the ROUTER socket: send a call to many ranks, match replies by id.

One design, in three mechanisms, each there for a measured reason:
- No I/O thread. A caller sends from its own thread, and a caller that waits receives
  the replies itself, in zmq's blocking receive, as a bare pyzmq ping-pong does (a hop
  through a thread of ours would add a thread wake-up to every round trip; docs/cuda.md,
  the host side). Whoever receives completes every call whose replies come, not just its own.
- One condition (`_cond`) guards the calls and the socket, which one thread at a time
  uses: the receiving thread, or a sender. Other waiters sleep on it and wake as calls
  finish; a sender that finds another thread receiving counts itself in `_senders`, so
  that the receiver lets it have the socket before it receives again.
- A nudge (transport/nudge.py): a message into the ROUTER from a socket of its own, which
  ends the receiver's wait at once. Senders nudge a receiving thread; so does a watcher
  thread when a worker dies (one pidfd per worker) or the ROUTER's monitor sees a peer
  disconnect. RCVTIMEO is bounded by the earliest call deadline and POLL_SLICE_S.

A worker that stops (SIGSTOP) is alive but silent: heartbeats drop its connection, a
Ping (or a call sent while nobody received) then fails for it, its calls fail with
WorkerStuckError and it is killed (stuck_ranks.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import zmq

from messages import Decoder, Encoder, ProtocolError, RpcReply
from zmqworker.executor import calls
from zmqworker.executor.calls import Call, Liveness, OwedAnswers, RpcFuture
from zmqworker.executor.errors import (
    ExecutorError,
    WorkerDiedError,
    WorkerError,
    WorkerStuckError,
)
from zmqworker.executor.stuck_ranks import StuckRanks, unreachable
from zmqworker.transport.frames import TooManyFrames, recv_frames, send_frames
from zmqworker.transport.nudge import NUDGE_IDENTITY, Nudger

log = logging.getLogger("zmqworker.executor")

SEND_TIMEOUT_S = 10.0  # how long a send waits on a live worker that reads nothing
POLL_SLICE_S = 0.1  # the longest a receive waits before deadlines are looked at again
CLOSE_WAIT_S = 5.0  # close(): the longest it waits for a thread to leave the socket

OnOther = Callable[["RpcClient", bytes, Any], None]


class RpcClient:
    def __init__(
        self,
        sock: zmq.Socket,
        liveness: Liveness,
        on_other: OnOther | None = None,
        send_timeout_s: float = SEND_TIMEOUT_S,
        stuck_after_s: float | None = None,
        max_request_bytes: int | None = None,
    ) -> None:
        """on_other(client, identity, message): messages that are not replies (the
        handshake's Hellos). send_timeout_s: how long a send may wait for a worker that is
        alive but leaves its messages unread once the queue to it is full (SNDTIMEO).
        stuck_after_s: the heartbeat timeout the ROUTER was bound with (None: none), after
        which a silent worker is stuck. max_request_bytes: the largest frame the workers
        take in (message_limits); a larger request fails here, before it is sent."""
        self.sock = sock
        self.liveness = liveness
        self.on_other = on_other
        self.identities: dict[int, bytes] = {}  # rank -> ROUTER identity (add_peer)
        self.dropped_messages = 0
        self.late_replies = 0
        self._all_ranks: list[int] = []  # sorted(identities)
        self._enc = Encoder()
        self._dec = Decoder()
        self._ids = itertools.count(1)
        self._calls: dict[int, Call] = {}
        self._owed = OwedAnswers()
        self._cond = threading.Condition(threading.RLock())  # re-entered by done-callbacks
        self._busy = False  # a thread uses the socket
        self._receiving = False  # ... and waits in its receive
        self._senders = 0  # threads waiting for the socket to send
        self._dead: ExecutorError | None = None
        self._closed = False  # no thread takes the socket from now on
        self._deaths: list[int] = []  # ranks whose death signal fired, in order
        self._rcvtimeo_ms = -1
        self.max_request_bytes = max_request_bytes
        self._stuck = None if stuck_after_s is None else StuckRanks(stuck_after_s)
        on_disconnect = None if self._stuck is None else self._stuck.on_disconnect
        self._nudger = Nudger(sock, liveness.fds, self._deaths.append, on_disconnect)
        self._send_timeout_s = 0.0
        self.send_timeout_s = send_timeout_s

    @property
    def dead(self) -> ExecutorError | None:
        """Why the workers serve no more: a death is looked for here too, no call open."""
        with self._cond:
            if self._dead is None and (died := self.liveness.check()) is not None:
                self._fail_all(died)
        return self._dead

    @property
    def owing(self) -> list[int]:
        """The ranks that have still not answered a call that timed out: busy with it, or
        wedged. A call sent to one waits behind it."""
        with self._cond:
            return self._owed.ranks

    @property
    def send_timeout_s(self) -> float:
        return self._send_timeout_s

    @send_timeout_s.setter
    def send_timeout_s(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {seconds!r}")
        with self._socket():
            self.sock.setsockopt(zmq.SNDTIMEO, max(1, round(seconds * 1000)))
        self._send_timeout_s = seconds

    def add_peer(self, rank: int, identity: bytes) -> None:
        """rank answers from the ROUTER identity identity (it said hello)."""
        with self._cond:
            self.identities[rank] = identity
            self._all_ranks = sorted(self.identities)

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | list[int] | None = None,
        non_block: bool = False,
    ) -> Any:
        """method on every rank that said hello: the results by rank, or only
        unique_reply_rank's (a list: theirs by rank); with non_block, an RpcFuture."""
        call = self._start(method, args, kwargs, None, timeout, unique_reply_rank, non_block)
        if non_block:
            assert call.future is not None
            return call.future
        self.wait_for(call.is_done)
        if call.error is not None:
            raise call.error
        return call.value

    def call(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        ranks: Iterable[int] | None = None,
        timeout: float | None = None,
        reply_rank: int | list[int] | None = None,
    ) -> RpcFuture:
        """Send method to ranks (default: all that said hello); a future of the results
        by rank, or of reply_rank's result alone (a list: theirs by rank)."""
        call = self._start(method, args, kwargs, ranks, timeout, reply_rank, True)
        assert call.future is not None
        return call.future

    def send_to(self, rank: int, msg: Any) -> None:
        """Send a message that is not a call (the handshake's Welcome) to one rank."""
        frames = self._enc.encode(msg)
        with self._socket():
            send_frames(self.sock, (self.identities[rank], *frames))

    def wait_for(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Receive (or wait for the thread that receives) until done() is true;
        TimeoutError after timeout seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if done():
                    return
                if self._closed:
                    raise self._dead or ExecutorError("the RPC client is closed")
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"not done within {timeout} s")
                if self._busy or self._senders:  # another thread has the socket, or wants it
                    self._cond.wait(POLL_SLICE_S if left is None else min(left, POLL_SLICE_S))
                    continue
                self._busy = self._receiving = True
                self._set_receive_timeout(left)
            identity = frames = None
            try:
                identity = self.sock.recv()  # blocks until a message, or RCVTIMEO
                frames = recv_frames(self.sock)  # the rest comes with its first frame
            except (zmq.Again, TooManyFrames) as e:  # none, or one refused: dropped below
                frames = e if isinstance(e, TooManyFrames) else None
            finally:
                with self._cond:
                    self._busy = self._receiving = False
                    if frames is not None and identity != NUDGE_IDENTITY:
                        self._handle(identity, frames)
                    self._after_receive()
                    self._cond.notify_all()

    def close(self, why: str = "the executor is shut down") -> None:
        """Fail the calls still open (a thread waiting on one leaves the ROUTER's
        receive), stop watching the liveness fds (close this before them), and release
        the client's own socket and fds (the ROUTER is its owner's)."""
        self.fail_all(ExecutorError(why))
        # No thread may be inside the ROUTER when its monitor goes and its owner closes
        # it: zmq sockets are not thread-safe, and libzmq aborts the process on misuse.
        end = time.monotonic() + CLOSE_WAIT_S
        with self._cond:
            self._closed = True
            while self._busy and time.monotonic() < end:
                if self._receiving:
                    self._nudger.nudge()
                self._cond.wait(POLL_SLICE_S)
        self._nudger.close(self.sock)

    def fail_all(self, error: ExecutorError) -> None:
        with self._cond:
            self._fail_all(error)
            receiving = self._receiving
        if receiving:
            self._nudger.nudge()

    # internals ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _socket(self) -> Iterator[None]:
        """The socket, for a send: a thread that receives is nudged out of its wait."""
        with self._cond:
            if self._closed:
                raise self._dead or ExecutorError("the RPC client is closed")
            if self._busy:
                self._senders += 1
                try:
                    while self._busy:
                        if self._receiving:
                            self._nudger.nudge()
                        self._cond.wait()
                finally:
                    self._senders -= 1
                if self._closed:
                    raise self._dead or ExecutorError("the RPC client is closed")
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _start(
        self,
        method: str,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        ranks: Iterable[int] | None,
        timeout: float | None,
        reply_rank: int | list[int] | None,
        with_future: bool,
    ) -> Call:
        with self._cond:
            self._check_alive()
            ranks = self._all_ranks if ranks is None else sorted(ranks)
            listed = [reply_rank] if isinstance(reply_rank, int) else reply_rank
            if listed is not None and (not listed or not set(listed) <= set(ranks)):
                raise ValueError(f"reply rank {reply_rank} is not one of the ranks {ranks}")
            call_id = next(self._ids)
            identities = [self.identities[rank] for rank in ranks]
        req = calls.new_request(call_id, method, args, kwargs, timeout, reply_rank)
        frames = calls.request_frames(self._enc, req, self.max_request_bytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        single = reply_rank if isinstance(reply_rank, int) else None
        call = Call(method, set(ranks if listed is None else listed), single, timeout, deadline)
        if with_future:
            call.future = RpcFuture(self.wait_for, call.is_done)
        with self._socket():
            with self._cond:
                self._check_alive()
                self._calls[call_id] = call
            for rank, identity in zip(ranks, identities, strict=True):
                try:  # a ROUTER sends to the peer whose identity leads the message
                    send_frames(self.sock, (identity, *frames))
                except zmq.Again:  # SNDTIMEO: that rank has not read its messages
                    stuck = WorkerStuckError.queue_full(rank, method, self.send_timeout_s)
                    with self._cond:
                        if rank != ranks[0]:  # the ranks before it run it: out of step
                            self._fail_all(stuck)
                        elif self._calls.pop(call_id, None) is not None:
                            call.finish(error=stuck)
                    break
                except zmq.ZMQError:  # ROUTER_MANDATORY: no connection to it
                    lost = unreachable(self.liveness, rank, method)  # a death, or killed
                    with self._cond:
                        self._fail_all(lost)
                    break
        return call

    def _set_receive_timeout(self, caller_left: float | None) -> None:
        """RCVTIMEO for the next receive: the caller's time left, the earliest deadline
        and POLL_SLICE_S, whichever comes first. Under the lock, with the socket."""
        wait_ms = calls.receive_wait_ms(self._calls, caller_left, POLL_SLICE_S)
        if wait_ms != self._rcvtimeo_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._rcvtimeo_ms = wait_ms

    def _handle(self, identity: bytes, frames: list[zmq.Frame] | TooManyFrames) -> None:
        """A message that came in (or its refusal, its frames taken off), under the lock."""
        try:
            if isinstance(frames, TooManyFrames):
                raise frames
            msg = self._dec.decode(frames)
        except ProtocolError as e:
            self.dropped_messages += 1
            log.warning("dropped a message that did not decode (peer %r): %s", identity, e)
            calls.fail_undecoded(e, identity, frames, self.identities, self._calls, self._owed)
            return
        if isinstance(msg, RpcReply) and self.identities.get(msg.rank) == identity:
            self._on_reply(msg)
        elif self.on_other is not None:
            self.on_other(self, identity, msg)
        else:
            self.dropped_messages += 1
            log.warning("dropped an unexpected %s (peer %r)", type(msg).__name__, identity)

    def _on_reply(self, reply: RpcReply) -> None:
        call = self._calls.get(reply.call_id)
        self._owed.answered(reply.rank, reply.call_id, call)
        if call is None:
            if reply.error is not None and reply.call_id < 0:
                log.warning(
                    "rank %d could not decode a message: %s", reply.rank, reply.error.message
                )
            self.late_replies += 1
        elif reply.error is not None:
            del self._calls[reply.call_id]
            call.finish(error=WorkerError(call.method, reply.error))
        elif reply.rank not in call.waiting_for:
            self.late_replies += 1
        elif call.add_result(reply.rank, reply.result):
            del self._calls[reply.call_id]  # before the callbacks, which may call again
            call.finish_with_results()

    def _after_receive(self) -> None:
        """Deaths, stuck ranks and expired deadlines, after every receive (under the
        lock, with the socket free)."""
        died = None
        if self._deaths:
            died = self.liveness.check() or WorkerDiedError(self._deaths[0], None)
        elif not self.liveness.fds and self._calls:  # nothing signals deaths: look
            died = self.liveness.check()
        if died is not None:
            self._fail_all(died)
        now = time.monotonic()
        stuck = self._stuck
        if stuck is not None:
            if stuck.probe_due(now):
                self._busy = True  # the lock is held and the socket was free: it is ours
                try:
                    stuck.probe(self.sock, self.identities, now)
                finally:
                    self._busy = False
            error = stuck.judge(self.liveness, self._dead is not None)
            if error is not None:
                self._fail_all(error)
        calls.expire(self._calls, self._owed, now)

    def _check_alive(self) -> None:
        # Deaths signalled while nobody received; without signals, look.
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
        failed, self._calls = self._calls, {}
        self._owed.clear()
        for call in failed.values():
            call.finish(error=error)
        self._cond.notify_all()
