"""The engine core's busy loop over its ROUTER socket.

Between two steps it takes in what its clients sent (requests, aborts, utility calls;
without waiting while it has work, blocking while it has none), then runs a step
(schedule, send, take outputs, update) and sends each client the outputs of its own
requests with the stats, one message per client per step (load_reports.py: the stats
alone to others). It never waits for a client: outputs queue in the socket (no high-water
mark) while its connection lives; a client whose connection is gone has its requests aborted.

A step that fails aborts every request (the clients get an EngineCoreFailure naming
them); one that fails because a worker died or is stuck is fatal: every client hears so,
and the engine core stops. So is a worker's death while the loop is idle (the executor
says so without a step), lest the next request fail for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from messages import (
    PROMPT_NOT_CACHED,
    AbortRequests,
    Decoder,
    Encoder,
    EngineCoreConfig,
    EngineCoreFailure,
    EngineCoreHello,
    EngineCoreReady,
    EngineCoreRequest,
    ProtocolError,
    UtilityCall,
    UtilityResult,
)
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.core import EngineCore
from zmqworker.engine.core_clients import Client, Clients
from zmqworker.engine.core_limits import engine_core_limits
from zmqworker.engine.load_reports import LoadReports
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.request_message import request_of
from zmqworker.engine.utility import EngineCoreUtilities, call_utility, waits_for_steps
from zmqworker.executor.errors import WORKERS_LOST, death_behind
from zmqworker.transport.curve import serve_core_securely
from zmqworker.transport.drops import DropCounter
from zmqworker.transport.frames import MAX_FRAMES, TooManyFrames, recv_frames, send_frames
from zmqworker.transport.host import host_id

log = logging.getLogger("zmqworker.engine")

IDLE_WAIT_S = 1.0  # the longest an idle loop sleeps before it looks around again
HEARTBEAT_IVL_S = 1.0
CLIENT_SILENT_S = 5.0  # a client silent this long (stopped, its host lost) is gone
CLOSE_LINGER_MS = 1000  # what the last messages get to leave before the socket closes
SHUTDOWN = "shutdown"  # the utility call after which the engine core stops
FATAL = WORKERS_LOST  # the executor cannot go on after these: a rank dead, stuck or wedged
ROUTED_FRAMES = MAX_FRAMES + 1  # a client's message and the identity the ROUTER adds


class EngineCoreServer:
    """Complete once constructed: its ROUTER is bound, and clients may connect and say
    hello while serve() starts the workers."""

    def __init__(self, config: EngineCoreConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.index = config.engine_index
        self.clients = Clients(config.token)
        self.reports = LoadReports(self.index)
        self.drops = DropCounter(log, f"messages at engine core {self.index}")
        self.core: EngineCore | None = None
        self.exit_status = 0
        self._enc, self._dec = Encoder(), Decoder()
        self._stop = False
        self._told_fatal = False  # every client heard that the engine core stops
        self._stopped_by: Client | None = None  # the client whose shutdown call stops it
        self._pusher: Client | None = None  # the client whose pushed update is under way
        self._ready: EngineCoreReady | None = None
        self._utilities: EngineCoreUtilities | None = None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)  # never wait for a client: see the module's doc
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, engine_core_limits(config.worker).input_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, round(HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(CLIENT_SILENT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, round(CLIENT_SILENT_S * 1000))
        self._zap = None
        try:
            self._zap = serve_core_securely(sock, ctx, config.address)
            sock.bind(config.address)
            self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except BaseException:
            sock.close(linger=0)
            if self._zap is not None:
                self._zap.stop()
            raise
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def serve(self, make_core: Callable[[], EngineCore]) -> int:
        """Start the engine (its workers, their KV cache, warm-up), then serve until a
        client asks for shutdown or a step fails for good; the exit status."""
        try:
            self.core = make_core()
        except BaseException as exc:
            self._fail_start(exc)
            raise
        core = self.core
        self._utilities = EngineCoreUtilities(core)
        self._ready = EngineCoreReady(
            engine_index=self.index,
            max_model_len=core.max_model_len,
            num_blocks=core.block_manager.num_blocks,
            block_size=core.block_manager.block_size,
            max_num_seqs=core.scheduler.max_num_seqs,
            vocab_size=self.config.vocab_size,
            num_workers=self.config.worker.parallel.world_size,
            pid=os.getpid(),
            worker_pids=list(getattr(core.executor, "pids", [])),
            kv_role=transfer.role if (transfer := self.config.worker.kv_transfer) else "",
            prefix_caching=core.block_manager.enable_prefix_caching,
            host_id=host_id(),
        )
        log.debug("ready for clients")
        try:
            self._loop(core)
        finally:
            self._shut_down(core)
        return self.exit_status

    def close(self) -> None:
        """Close the sockets (the last messages get CLOSE_LINGER_MS to leave)."""
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=CLOSE_LINGER_MS)
        if self._zap is not None:
            self._zap.stop()

    # the loop ---------------------------------------------------------------------------

    def _loop(self, core: EngineCore) -> None:
        while not self._stop:
            clients = self.clients.by_identity.values()
            self.reports.send(core.load, core.stats, clients, self._send_frames)
            idle = not core.has_work() or core.not_ready() is not None
            self._take_inputs(wait=idle)
            lost = core.executor.failure if idle and not self._stop else None
            if lost is not None:  # a worker died between steps: no step will say so
                self._fail_requests(lost, fatal=True)
            if self._stop or not core.has_work():
                continue
            if (why := core.not_ready()) is not None:
                self._hold_steps(core, why)
                continue
            self._step(core.step)
            self._settle(core)

    def _hold_steps(self, core: EngineCore, why: str) -> None:
        """No step may run now. While a pushed update's rows come, the requests wait for
        its end, and run on across it. Once an update failed part-way, nothing may ever
        let them run: they fail with why, and go."""
        if core.weights.pushing or not self.clients.owners:
            return
        for request_id in list(self.clients.owners):
            core.abort_request(request_id, counted=False)
        self._fail_requests(RuntimeError(f"no step: {why}"), fatal=False)

    def _settle(self, core: EngineCore) -> None:
        """Steps still in flight once every request has finished (or was aborted) hold
        only dropped tokens: take them back before reading on or answering, so that
        their blocks are free again and an idle engine core's stats are settled. KV
        transfers under way are not waited for here (the loop polls them between reads):
        a prefill instance takes new requests while its staged KV waits."""
        while not self._stop and len(core.batch_queue) and not core.num_unfinished:
            if core.scheduler.has_unfinished_requests():  # KV transfers under way
                return
            self._step(core.step)

    def _step(self, run: Callable[[], list[Request]]) -> None:
        assert self.core is not None
        try:
            changed = run()
        except Exception as exc:
            executor = self.core.executor
            lost = exc if isinstance(exc, FATAL) else death_behind(exc, lambda: executor.failure)
            self._fail_requests(lost or exc, fatal=lost is not None)
            return
        for request, reason in self.core.take_failed():  # their grammar did not compile
            self._fail_one(request.req_id, "ValueError", reason)
        declined = self.core.scheduler.declined  # the scheduler's outbox
        while declined:  # not run, for a prefill instance (Request.declines)
            request = declined.popleft()
            assert request.error is not None  # why, from the scheduler
            self._fail_one(request.req_id, PROMPT_NOT_CACHED, request.error)
        # Each client's requests, each once (a step may change one twice), in order.
        by_client: dict[bytes, dict[str, Request]] = {}
        owners = self.clients.owners
        for request in changed:
            client = owners.get(request.req_id)
            if client is None:
                continue  # its client is gone, or aborted it while the step ran
            if request.finish_reason is FinishReason.ABORT:  # no remote KV, or grammar refused
                reason = request.error or "aborted by the engine core"
                self._fail_one(request.req_id, "RuntimeError", reason)
                continue
            by_client.setdefault(client.identity, {})[request.req_id] = request
            if request.is_finished:
                self.clients.finished(request.req_id, request.kv_transfer_out is not None)
        self.clients.prune_held(self.core.holds_kv)
        if not by_client:
            return
        stats = self.core.stats()
        for identity, requests in by_client.items():
            client = self.clients.by_identity.get(identity)
            if client is not None:
                self._send(client, client_outputs(self.index, requests.values(), stats))
                self.reports.told(client, stats)

    def _fail_one(self, request_id: str, exc_type: str, reason: str) -> None:
        """A request that failed alone: out of its client's, which is told (if any)."""
        client = self.clients.forget_request(request_id)
        if client is not None:
            self._send(client, EngineCoreFailure(self.index, [request_id], exc_type, reason))

    def _take_inputs(self, wait: bool) -> None:
        if wait:  # until a client sends, or a probe or a held-back load report is due
            now = time.monotonic()
            due = [IDLE_WAIT_S, self.clients.next_probe_in(now), self.reports.next_in(now)]
            self._poller.poll(math.ceil(min(d for d in due if d is not None) * 1000))
        self._read_monitor()
        for client in self.clients.probe(self._sock, time.monotonic()):
            self._drop_client(client)
        while not self._stop:
            try:
                frames = recv_frames(self._sock, max_frames=ROUTED_FRAMES)
            except zmq.Again:
                return
            except TooManyFrames as exc:  # taken off whole, dropped
                self.drops.count(f"refused {exc}")
                continue
            self._handle(frames[0].bytes, frames[1:])

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.clients.on_disconnect(time.monotonic())

    # messages ---------------------------------------------------------------------------

    def _handle(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        try:
            msg = self._dec.decode(frames)
        except ProtocolError as exc:
            self.drops.count(f"a message that did not decode: {exc}")
            if exc.version is not None and identity not in self.clients.by_identity:
                refusal = self.clients.version_refusal(self.index, exc.version)
                with contextlib.suppress(zmq.ZMQError):  # gone already
                    send_frames(self._sock, (identity, *self._enc.encode(refusal)), zmq.NOBLOCK)
            return
        client = self.clients.heard_from(identity)
        if isinstance(msg, EngineCoreHello):
            self._hello(identity, msg)
        elif client is None:
            self.drops.count(f"a {type(msg).__name__} from a peer that has not said hello")
        elif isinstance(msg, EngineCoreRequest):
            self._add_request(client, msg)
        elif isinstance(msg, AbortRequests):
            assert self.core is not None
            for request_id in self.clients.abort(client, msg.request_ids):
                self.core.abort_request(request_id, counted=msg.reason == "abort")
        elif isinstance(msg, UtilityCall):
            self._utility(client, msg)
        else:
            self.drops.count(f"a {type(msg).__name__}, which no client sends")

    def _hello(self, identity: bytes, hello: EngineCoreHello) -> None:
        client = self.clients.admit(identity, hello)
        if client is None:
            self.drops.count(f"a Hello from pid {hello.pid}: the wrong token or version, or twice")
        elif self._ready is not None:
            self._send(client, self._ready)

    def _add_request(self, client: Client, msg: EngineCoreRequest) -> None:
        assert self.core is not None
        try:
            if (reason := self.core.not_ready()) is not None:
                raise RuntimeError(reason)
            if msg.request_id in self.clients.owners:
                raise ValueError(f"request id {msg.request_id!r} is already running")
            self.core.add_request(request_of(msg, self.config))
        except (RuntimeError, ValueError) as exc:
            kind = type(exc).__name__
            self._send(client, EngineCoreFailure(self.index, [msg.request_id], kind, str(exc)))
            return
        self.clients.add_request(client, msg.request_id)

    def _utility(self, client: Client, call: UtilityCall) -> None:
        assert self.core is not None
        if call.method == SHUTDOWN:
            log.debug("shutdown asked by %s", client)
            self._stop = True
            self._stopped_by = client
            self._send(client, UtilityResult(call.call_id))
            return
        self._settle(self.core)
        try:
            if waits_for_steps(call.method):
                self._step(self.core.drain)  # their outputs go out first
            assert self._utilities is not None
            result = call_utility(self._utilities, call)
            self._pusher = (self._pusher or client) if self.core.weights.pushing else None
            frames = self._enc.encode(UtilityResult(call.call_id, result))
        except Exception as exc:
            error = UtilityResult(call.call_id, exc_type=type(exc).__name__, message=str(exc))
            frames = self._enc.encode(error)
        self._send_frames(client, frames)

    def _send(self, client: Client, msg: object) -> None:
        self._send_frames(client, self._enc.encode(msg))  # type: ignore[arg-type]

    def _send_frames(self, client: Client, frames: list) -> None:
        try:
            send_frames(self._sock, (client.identity, *frames), zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): its connection is gone
            self._drop_client(client)

    # failures and the end ------------------------------------------------------------

    def _drop_client(self, client: Client) -> None:
        orphans = self.clients.remove(client)
        assert self.core is not None
        if client is self._pusher:  # nothing will end its push: the weights are neither
            self.core.weights.abandon_push()
        for request_id in orphans:
            self.core.abort_request(request_id)
        level = logging.WARNING if orphans else logging.INFO
        log.log(level, "%s is gone; %d of its requests aborted", client, len(orphans))

    def _fail_requests(self, exc: Exception, fatal: bool) -> None:
        """After a failed step (every request aborted): tell each client which of its
        requests failed; when the workers are gone (fatal: in a step or between steps),
        tell every client and stop."""
        what = "its workers are gone" if fatal else "a step failed"
        log.error("engine core %d: %s: %s", self.index, what, exc)
        for client in list(self.clients.by_identity.values()):
            request_ids = sorted(client.request_ids)
            for request_id in request_ids:
                self.clients.forget_request(request_id)
            if request_ids or fatal:
                failure = EngineCoreFailure(
                    self.index, request_ids, type(exc).__name__, str(exc), fatal=fatal
                )
                self._send(client, failure)
        if fatal:
            self._stop = self._told_fatal = True
            self.exit_status = 1

    def _shut_down(self, core: EngineCore) -> None:
        """Fail what the clients still wait for, then stop the workers."""
        for client in [] if self._told_fatal else list(self.clients.by_identity.values()):
            if client is self._stopped_by:
                continue
            failure = EngineCoreFailure(
                self.index,
                sorted(client.request_ids),
                "EngineCoreStopped",
                f"engine core {self.index} shut down",
                fatal=True,
            )
            self._send(client, failure)
        core.shutdown()

    def _fail_start(self, exc: BaseException) -> None:
        """Tell the clients that said hello already why the engine core did not start."""
        while True:
            try:
                frames = recv_frames(self._sock, max_frames=ROUTED_FRAMES)
                msg = self._dec.decode(frames[1:])
            except zmq.Again:
                break
            except ProtocolError:  # TooManyFrames too: taken off whole
                continue
            if isinstance(msg, EngineCoreHello):
                self.clients.admit(frames[0].bytes, msg)
        message = str(exc) or type(exc).__name__
        for client in self.clients.by_identity.values():
            self._send(
                client, EngineCoreFailure(self.index, [], type(exc).__name__, message, fatal=True)
            )
