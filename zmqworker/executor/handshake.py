"""The engine's half of start-up and polite shutdown, shared by every executor.

Whatever starts the workers (subprocesses, Ray actors), each connects a DEALER to the
engine's ROUTER and sends a Hello (protocol version, rank, pid, token, data address).
Only a Hello with the right token from the expected process is accepted; once every
rank has said hello, each gets a Welcome with the configuration and every rank's data
address (the pipeline channel's address exchange).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import zmq

from messages import PROTOCOL_VERSION, Hello, Welcome, WorkerConfig
from zmqworker.executor.calls import Liveness
from zmqworker.executor.errors import (
    ExecutorError,
    WorkerDiedError,
    WorkerStartupError,
    WorkerStuckError,
)
from zmqworker.executor.rpc_client import RpcClient
from zmqworker.executor.stuck_ranks import unreachable
from zmqworker.transport.curve import RunKeys, make_server
from zmqworker.transport.heartbeats import keep_alive

log = logging.getLogger("zmqworker.executor")

STUCK_AFTER_S = 2.0  # a worker silent (no ZMTP heartbeat) for this long is stuck
# A worker's wait for its Welcome outlasts the engine's start-up bound by this, so that the
# engine's wait for every Hello ends first and names the rank(s) it did not hear from.
WELCOME_MARGIN_S = 5.0
LATE_REPLIES_S = 0.2  # how long a shutdown reads replies still owed before it decides


def bind_router(
    ctx: zmq.Context,
    endpoint: str,
    max_message_bytes: int,
    stuck_after_s: float | None,
    keys: RunKeys | None = None,
) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to endpoint: ipc://PATH, or tcp://HOST (a random free port).
    Returns the socket and the address workers connect to. max_message_bytes: the
    largest frame a peer may send (the run's MessageLimits.reply_bytes); stuck_after_s:
    ZMTP heartbeats drop a peer silent for that long, and tell the workers to drop an
    engine silent for that long (None: no heartbeats); keys: the
    ROUTER is the run's CURVE server (its ZAP handler must run)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    # Replies come only for the calls this engine made, so their queue needs no bound;
    # a bound would stop the reading of a peer whose replies wait unread, and with
    # heartbeats libzmq then times that live peer out and aborts the process (libzmq
    # issues 3937 and 4364: "Assertion failed: !_io_error", stream_engine_base.cpp).
    sock.setsockopt(zmq.RCVHWM, 0)
    if stuck_after_s is not None:
        # Told to the workers too: one that then hears nothing for as long drops its
        # connection and leaves, as when the engine dies (its host lost, or stopped: no
        # connection is closed then). Our workers also ping from their side from the
        # start (ENGINE_SILENT_ENV), before the first heartbeat tells them the bound.
        keep_alive(sock, stuck_after_s, tell_peer=True)
    if keys is not None:
        make_server(sock, keys.engine_public, keys.engine_secret)
    try:
        if endpoint.startswith("ipc://"):
            sock.bind(endpoint)
            return sock, endpoint
        if endpoint.startswith("tcp://"):
            port = sock.bind_to_random_port(endpoint)
            return sock, f"{endpoint}:{port}"
    except BaseException:
        sock.close(linger=0)
        raise
    sock.close(linger=0)
    raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST, got {endpoint!r}")


def new_token() -> str:
    """A run's handshake token: what a worker's Hello must carry to be accepted."""
    return secrets.token_hex(16)


class Handshake:
    """Accepts one Hello per rank, from the process expected for it (pids[rank]) with the
    run's token and protocol version, then welcomes them all. on_hello is the
    RpcClient's handler of the messages that are not replies."""

    def __init__(self, world_size: int, token: str, pids: Sequence[int]) -> None:
        if len(pids) != world_size:
            raise ValueError(f"{len(pids)} worker pids for {world_size} ranks")
        self.world_size = world_size
        self.token = token
        self.run_id = secrets.token_hex(16)  # every pipeline message of the run carries it
        self.hellos: dict[int, Hello] = {}
        self._pids = list(pids)

    def run(
        self,
        rpc: RpcClient,
        config: WorkerConfig,
        timeout: float,
        per_rank_env: list[dict[str, str]] | None = None,
        stuck_after_s: float | None = STUCK_AFTER_S,
    ) -> None:
        """Wait (at most timeout seconds) for every Hello, then send every Welcome. A
        worker that dies meanwhile raises its WorkerDiedError; one stopped for
        stuck_after_s (None: never judged), or found stuck once connected, is killed and
        raises WorkerStuckError: each names its rank, without waiting out the timeout."""
        liveness = rpc.liveness
        stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped
        failed: list[ExecutorError] = []

        def settled() -> bool:
            if len(self.hellos) == self.world_size:
                return True
            error = rpc.dead or self._stopped(liveness, stopped_since, stuck_after_s)
            if error is not None:
                failed.append(error)
                rpc.fail_all(error)  # the run is over: no polite shutdown for it
            return error is not None

        try:
            rpc.wait_for(settled, timeout)
        except TimeoutError:
            missing = sorted(set(range(self.world_size)) - set(self.hellos))
            raise WorkerStartupError(
                f"no handshake from rank(s) {missing} within {timeout:.0f} s (the start-up "
                "bound): their processes run, but did not connect and say hello"
            ) from None
        if failed:
            raise failed[0]
        addresses = [self.hellos[r].data_address for r in range(self.world_size)]
        for rank in range(self.world_size):
            env = per_rank_env[rank] if per_rank_env else {}
            welcome = Welcome(config=config, env=env, data_addresses=addresses, run_id=self.run_id)
            try:
                rpc.send_to(rank, welcome)
            except zmq.ZMQError:  # EHOSTUNREACH: its connection is gone
                error = unreachable(liveness, rank, "the Welcome")
                rpc.fail_all(error)
                raise error from None

    def _stopped(
        self, liveness: Liveness, since: dict[int, float], bound: float | None
    ) -> WorkerStuckError | None:
        """The error for the ranks whose processes have stayed stopped for bound seconds
        (they are killed), if any: a stopped process never says hello, and answers no
        heartbeat once it has."""
        if bound is None:
            return None
        now = time.monotonic()
        for rank in range(self.world_size):
            if liveness.stopped(rank):
                since.setdefault(rank, now)
            else:
                since.pop(rank, None)
        stuck = sorted(r for r, t in since.items() if now - t >= bound)
        if not stuck:
            return None
        for rank in stuck:
            log.error("worker rank %d is stopped during start-up: killing it", rank)
            liveness.kill(rank)
        return WorkerStuckError.stopped(stuck[0], now - since[stuck[0]], "every Hello")

    def on_hello(self, rpc: RpcClient, identity: bytes, msg: Any) -> None:
        ok = (
            isinstance(msg, Hello)
            and hmac.compare_digest(msg.token.encode(), self.token.encode())
            and msg.protocol_version == PROTOCOL_VERSION
            and 0 <= msg.rank < self.world_size
            and msg.rank not in rpc.identities
            and msg.pid == self._pids[msg.rank]
        )
        if not ok:
            rpc.dropped_messages += 1
            log.warning("dropped an unexpected %s from peer %r", type(msg).__name__, identity)
            return
        self.hellos[msg.rank] = msg
        rpc.add_peer(msg.rank, identity)


def polite_shutdown(rpc: RpcClient, world_size: int, timeout: float) -> bool:
    """Ask every worker to shut down, when all are connected and none died; True when
    every one answered, or exited with status 0 (it shut down as asked, before its answer
    left: LINGER 0), within timeout (they then stop by themselves). A rank found stopped
    meanwhile is killed at once: it would answer nothing, SIGTERM included. Nobody is
    asked while a rank still owes the reply to a call that timed out: its answer would
    wait behind that call, and the timeout with it."""
    if rpc.dead is not None or len(rpc.identities) != world_size:
        return False
    if rpc.owing:  # late answers that came while nobody received take their ranks off
        with contextlib.suppress(TimeoutError):
            rpc.wait_for(lambda: not rpc.owing, timeout=LATE_REPLIES_S)
    owing = rpc.owing
    if owing:
        log.warning("rank(s) %s never answered a call that timed out: not asked to shut down",
                    owing)  # fmt: skip
        return False
    end = time.monotonic() + timeout
    try:
        rpc.call("shutdown", timeout=timeout).result()
    except WorkerDiedError as e:
        if e.exit_status == 0:  # one left as asked: the others must have, too
            return _all_exit_cleanly(rpc.liveness, world_size, end)
        log.warning("polite shutdown failed: %s", e)
        return False
    except Exception as e:  # a worker that cannot shut down politely is stopped harder
        log.warning("polite shutdown failed: %s", e)
        return False
    return True


def _all_exit_cleanly(liveness: Liveness, world_size: int, end: float) -> bool:
    """Whether every rank exits with status 0 by end (monotonic); False at once when one
    exits otherwise or is stopped (then killed)."""
    while True:
        statuses = [liveness.exit_status(rank) for rank in range(world_size)]
        if all(status == 0 for status in statuses):
            return True
        failed = [r for r, status in enumerate(statuses) if status not in (None, 0)]
        stopped = [r for r, status in enumerate(statuses) if status is None and liveness.stopped(r)]
        for rank in stopped:
            log.error("worker rank %d is stopped: it cannot shut down; killing it", rank)
            liveness.kill(rank)
        if failed or stopped:
            log.warning(
                "polite shutdown failed: rank(s) %s did not exit as asked", failed + stopped
            )
            return False
        if time.monotonic() >= end:
            waited = [r for r, status in enumerate(statuses) if status is None]
            log.warning("polite shutdown failed: rank(s) %s did not exit in time", waited)
            return False
        time.sleep(0.01)
