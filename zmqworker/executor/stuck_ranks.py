"""Finding a stuck rank: alive (its process runs) but silent (stopped, or wedged).

The ROUTER's ZMTP heartbeats (set where the executor binds it; answered by each worker's
libzmq I/O thread, without Python) drop the connection of a peer silent for
stuck_after_s, and its monitor says a peer disconnected. The ROUTER forgets that peer a
few of its own commands later, so for PROBE_WINDOW_S the RpcClient Pings every rank at
each receive: a rank the ROUTER cannot reach (ROUTER_MANDATORY) is dead or stuck. A
death shows within DEATH_GRACE_S (its socket closes as it dies, a moment before it can be
reaped); a rank whose death has not shown by then is stuck, and is killed. A send that
finds a rank unreachable (the engine idle when heartbeats dropped it) is judged the same
way, at once (unreachable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import zmq

from messages import Encoder, Ping
from zmqworker.executor.calls import Liveness
from zmqworker.executor.errors import ExecutorError, WorkerStuckError
from zmqworker.transport.frames import send_frames

log = logging.getLogger("zmqworker.executor")

DEATH_GRACE_S = 0.3
PROBE_WINDOW_S = 1.0
PROBE_EVERY_S = 0.05


class StuckRanks:
    """The probing state of one RpcClient. Its methods run under the client's lock; probe
    also with the client's socket, which the caller holds."""

    def __init__(self, stuck_after_s: float) -> None:
        self.stuck_after_s = stuck_after_s
        self._ping = Encoder().encode(Ping())
        self._disconnected = False  # set by the watcher thread: probe the ranks
        self._probe_until = 0.0  # monotonic: probe every PROBE_EVERY_S until then
        self._next_probe = 0.0
        self._unreachable: dict[int, float] = {}  # rank -> when found so, no death seen

    def on_disconnect(self) -> None:
        """The ROUTER's monitor saw a peer disconnect (on the watcher thread)."""
        self._disconnected = True

    def probe_due(self, now: float) -> bool:
        """Whether probe should run now."""
        if self._disconnected:
            self._disconnected = False
            self._probe_until = now + PROBE_WINDOW_S
        if now < self._probe_until and now >= self._next_probe:
            self._next_probe = now + PROBE_EVERY_S
            return True
        return False

    def probe(self, sock: zmq.Socket, identities: Mapping[int, bytes], now: float) -> None:
        """Ping every rank; note those the ROUTER cannot reach."""
        for rank, identity in identities.items():
            try:
                send_frames(sock, (identity, *self._ping), zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: connected, at least
                continue
            except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): no connection
                self._unreachable.setdefault(rank, now)
                self._probe_until = 0.0

    def judge(self, liveness: Liveness, dead: bool) -> ExecutorError | None:
        """The error to fail every call with, if an unreachable rank turned out dead or
        stuck (a stuck one is killed); None while the grace lasts. dead: the client
        failed already."""
        if not self._unreachable:
            return None
        died = liveness.check()
        if died is not None or dead:
            self._unreachable.clear()
            return died
        now = time.monotonic()
        stuck = [r for r, since in self._unreachable.items() if now - since >= DEATH_GRACE_S]
        if not stuck:
            return None
        self._unreachable.clear()
        log.error("worker rank %d is silent: stopped or wedged; killing it", stuck[0])
        error = WorkerStuckError.silent(stuck[0], self.stuck_after_s + DEATH_GRACE_S)
        for rank in stuck:
            liveness.kill(rank)
        return error


def unreachable(liveness: Liveness, rank: int, what: str) -> ExecutorError:
    """The error for rank, which the ROUTER could not reach (EHOSTUNREACH) to send it
    what: a death, if one shows within DEATH_GRACE_S; else the rank is alive but cut off
    (stopped, or wedged below Python, while nobody received), and is killed. Call it
    without the client's lock: it waits."""
    end = time.monotonic() + DEATH_GRACE_S
    while (died := liveness.check()) is None and time.monotonic() < end:
        time.sleep(0.01)
    if died is not None:
        return died
    log.error("worker rank %d cannot be reached but has not died: killing it", rank)
    liveness.kill(rank)
    return WorkerStuckError.unreachable(rank, what, DEATH_GRACE_S)
