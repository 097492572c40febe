"""The worker process: one rank, one DEALER socket to the engine, one event loop.

The loop owns the socket: it decodes requests and routes every call the same way. Calls
run on the compute thread, one at a time in arrival order; the methods that must be
answered while another call runs (CONCURRENT_METHODS: health checks) run on a side
thread. Each reply goes out as soon as its result is ready, an AsyncModelRunnerOutput
once its device-to-host copy is done. While the compute thread has nothing to do, it
waits on the socket itself (compute_thread.py): a call that finds it idle is received,
routed and run there, with no hand-off between threads.

The server builds the worker when the Welcome comes (the engine's configuration and this
rank's environment), with the pipeline stage this rank's steps use; the step's own logic
is the worker's (Worker.execute_model).

Faults: every receiving socket bounds its frames (the engine's limits, MAX_MESSAGE_ENV);
on tcp every socket is CURVE-authenticated with the run's keys. A process whose engine is
gone, or that gets SIGTERM, leaves at once (fast_exit.py). A call that runs longer than
STACK_DUMP_AFTER_S has every thread's stack written to stderr (once per call), so that a
long step shows where it is.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from typing import Any

import zmq

from messages import (
    PROTOCOL_VERSION,
    Decoder,
    Hello,
    Ping,
    ProtocolError,
    RpcRequest,
    Welcome,
)
from messages.rpc import CONCURRENT_METHODS
from zmqworker.distributed.pipeline_stage import PipelineStage
from zmqworker.distributed.pp_receiver import PipelineReceiver
from zmqworker.distributed.pp_sender import PipelineSender
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.runtime.compute_thread import ComputeThread, Job
from zmqworker.runtime.engine_watch import EngineWatch
from zmqworker.runtime.fast_exit import fast_exit
from zmqworker.runtime.parent_death import PARENT_DEATH_SIGNAL, release_parent_death
from zmqworker.runtime.replies import Replier, peek_call_id
from zmqworker.runtime.sockets import default_data_bind, remove_socket_file
from zmqworker.transport.async_socket import AsyncSocket
from zmqworker.transport.curve import WorkerKeys, make_client, start_zap
from zmqworker.transport.drops import DropCounter
from zmqworker.transport.frames import TooManyFrames
from zmqworker.transport.heartbeats import keep_alive
from zmqworker.transport.spawn_env import HANDSHAKE_TIMEOUT_S
from zmqworker.worker.wrapper import WorkerWrapper

log = logging.getLogger("zmqworker.worker")

SHUTDOWN_TIMEOUT_S = 10.0
COMPUTE_JOIN_S = 1.0  # how long an exiting worker lets its compute thread finish
STOP_AFTER = frozenset({"shutdown"})  # the server stops once it has answered these
STACK_DUMP_AFTER_S = 120.0  # a call running longer has its threads' stacks logged
WATCH_EVERY_S = 1.0


class WorkerServer:
    """Complete once constructed: its sockets are connected and bound (the pipeline's
    receiver too, whose address the Hello carries); run() does the handshake and serves.

    worker_kwargs: the worker's constructor arguments besides its config and rank (a Ray
    actor's local_rank and rendezvous address). handle_signals: SIGINT stops the server,
    SIGTERM ends the process at once (main thread only). keys: the run's CURVE keys (tcp);
    max_*_bytes: the largest frame the engine's and the pipeline's sockets take in;
    welcome_timeout_s: how long it waits for its Welcome after its Hello (None: no bound);
    engine_silent_s: it pings the engine and leaves once the engine has answered none of
    its pings for that long (the engine's stuck bound; None: it pings not, and learns the
    bound from the engine's first heartbeat)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        engine_address: str,
        rank: int,
        token: str,
        parent_pid: int | None = None,
        data_bind: str | None = None,
        worker_kwargs: dict[str, Any] | None = None,
        handle_signals: bool = True,
        keys: WorkerKeys | None = None,
        max_request_bytes: int = -1,
        max_pipeline_bytes: int = -1,
        max_reply_bytes: int = -1,
        welcome_timeout_s: float | None = HANDSHAKE_TIMEOUT_S,
        engine_silent_s: float | None = None,
    ) -> None:
        self.engine_address = engine_address
        self.welcome_timeout_s = welcome_timeout_s
        self.rank = rank
        self.token = token
        self.drops = DropCounter(log, f"messages at rank {rank}")
        self.wrapper = WorkerWrapper(rpc_rank=rank)
        self._loop = loop
        self._worker_kwargs = dict(worker_kwargs or {})
        self._handle_signals = handle_signals
        self._dec = Decoder()
        self._idle_dec = Decoder()  # the compute thread's, for what it receives while idle
        self._side = ThreadPoolExecutor(2, thread_name_prefix=f"side-{rank}")
        self._welcomed: asyncio.Future[None] = loop.create_future()
        self._stopped = asyncio.Event()
        self._init_error: BaseException | None = None
        self._welcome_taken = False  # set by whichever thread receives the Welcome
        self._engine_lost = ""
        self._parent_pid = parent_pid
        self._pipeline: PipelineStage | None = None
        self._keys = keys
        self._dumped_for: float | None = None  # the busy_since of the call last dumped
        ctx = zmq.Context.instance()
        # A failure part-way (a bad address, a port taken) closes what was opened: a Ray
        # actor's process lives on after it.
        with ExitStack() as undo:
            undo.callback(self._side.shutdown, wait=False)
            self._zap = start_zap(ctx, keys.public) if keys is not None else None
            if self._zap is not None:
                undo.callback(self._zap.stop)
            self._pp_in = PipelineReceiver(
                ctx,
                data_bind or default_data_bind(engine_address, rank),
                rank,
                max_pipeline_bytes,
                keys,
            )
            undo.callback(self._pp_in.close)
            self._pp_in.start(loop)
            sock = ctx.socket(zmq.DEALER)
            undo.callback(sock.close, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_request_bytes)
            if keys is not None:
                make_client(sock, keys, keys.engine_public)
            if engine_silent_s is not None:  # pinged from the start: EngineWatch sees the drop
                keep_alive(sock, engine_silent_s)
            # Watched before it connects: a handshake done before the monitor is there
            # would go unseen, and a drop after it unheeded. Before the compute thread
            # exists: it uses the socket as soon as it starts.
            self._watch = EngineWatch(sock, loop, self._on_engine_lost, parent_pid)
            undo.callback(self._watch.close)
            sock.connect(engine_address)
            self._sock = AsyncSocket(sock, loop, self._on_message, self._on_refused)
            undo.callback(self._sock.close)
            self._loop_reply = Replier(rank, self._sock.send, max_reply_bytes)
            self._compute_reply = Replier(rank, self._sock.send_threadsafe, max_reply_bytes)
            self._compute = ComputeThread(f"compute-{rank}", self._sock, self._on_idle_message)
            undo.pop_all()

    @property
    def protocol_errors(self) -> int:
        return self.drops.total

    async def run(self) -> int:
        if self._handle_signals:
            self._loop.add_signal_handler(signal.SIGINT, self._stop, "signal SIGINT")
            self._loop.add_signal_handler(signal.SIGTERM, self._leave_now, "signal SIGTERM")
            # Only a worker whose parent is its engine takes the signal for the engine's
            # death; any other keeps SIGHUP as it inherited it (nohup's SIG_IGN, say).
            if self._parent_pid is not None:
                self._loop.add_signal_handler(
                    PARENT_DEATH_SIGNAL, self._on_engine_lost, "the engine process exited"
                )
                release_parent_death()  # held since before the request (main.py)
        self._loop.call_later(WATCH_EVERY_S, self._watch_calls)
        try:
            self._sock.send(self._loop_reply.enc.encode(self._hello()))
            try:
                await asyncio.wait_for(self._welcomed, self.welcome_timeout_s)
            except asyncio.TimeoutError:
                bound = self.welcome_timeout_s
                log.error("no Welcome from %s within %g s", self.engine_address, bound)
                return 3
            except asyncio.CancelledError:
                return 0  # stopped (signal, engine gone) before the handshake finished
            await self._stopped.wait()
            return 0
        finally:
            await self._close()

    def stop_threadsafe(self, why: str) -> None:
        """Stop the server from another thread (a Ray actor's shutdown)."""
        self._loop.call_soon_threadsafe(self._stop, why)

    def _hello(self) -> Hello:
        return Hello(
            protocol_version=PROTOCOL_VERSION,
            rank=self.rank,
            pid=os.getpid(),
            token=self.token,
            hostname=socket.gethostname(),
            data_address=self._pp_in.address,
        )

    # messages -------------------------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        """On the loop: a call for the compute thread is queued there."""
        job = self._route(frames, self._dec, self._loop_reply)
        if job is not None:
            self._compute.submit(*job)

    def _on_refused(self, error: TooManyFrames) -> None:
        """On the loop: a message of too many frames was dropped whole; its call fails
        at once where its first frame names it, as one that does not decode."""
        self._loop_reply.error(peek_call_id([error.first]), error)

    def _on_idle_message(self, frames: list[zmq.Frame]) -> Job | None:
        """On the compute thread, which received this while it had nothing to do: a call
        for it runs at once (the Welcome too: it must run before the calls after it)."""
        return self._route(frames, self._idle_dec, self._compute_reply)

    def _route(self, frames: list[zmq.Frame], dec: Decoder, reply: Replier) -> Job | None:
        """Where a message goes: the compute thread's job for it (returned), a side
        thread, or an error reply. Each thread decodes with a decoder of its own."""
        try:
            msg = dec.decode(frames)
        except ProtocolError as e:
            self.drops.count(f"did not decode: {e}")
            reply.error(peek_call_id(frames), e)
            return None
        if isinstance(msg, Welcome):
            if self._welcome_taken:
                self.drops.count("a second Welcome")
                return None
            self._welcome_taken = True
            return partial(self._init_worker, msg), self._on_init_done
        if isinstance(msg, Ping):  # the engine's check that it can still reach this rank
            return None
        if not isinstance(msg, RpcRequest):
            self.drops.count(f"an unexpected {type(msg).__name__}")
            return None
        self._pp_in.note_call(msg.call_id)
        if msg.deadline and time.time() > msg.deadline:
            reply.error(msg.call_id, TimeoutError(f"{msg.method} arrived after its deadline"))
            return None
        if msg.method in CONCURRENT_METHODS:
            self._loop.call_soon_threadsafe(self._run_beside, msg, partial(self._call, msg))
            return None
        return partial(self._call, msg), partial(self._on_computed, msg)

    def _call(self, req: RpcRequest) -> Any:
        if self._init_error is not None:
            raise RuntimeError(f"the worker could not be created: {self._init_error}")
        return self.wrapper.execute_method(
            req.method, *req.args, call_id=req.call_id, deadline=req.deadline, **req.kwargs
        )

    def _on_computed(self, req: RpcRequest, result: Any, error: BaseException | None) -> None:
        """On the compute thread: reply at once, unless an output awaits its copy."""
        if isinstance(result, AsyncModelRunnerOutput) and error is None:
            try:
                if not result.is_ready():
                    self._loop.call_soon_threadsafe(self._run_beside, req, result.get_output)
                    return
                result = result.get_output()
            except Exception as e:  # a device fault seen here: the engine must hear of it
                result, error = None, e
        self._compute_reply.finish(req, result, error)
        if req.method in STOP_AFTER and error is None:
            self._loop.call_soon_threadsafe(self._stop, f"{req.method} requested")

    def _run_beside(self, req: RpcRequest, fn: Callable[[], Any]) -> None:
        """On the loop: run fn on a side thread and reply with its result."""

        async def run() -> None:
            try:
                result = await self._loop.run_in_executor(self._side, fn)
            except Exception as e:
                self._loop_reply.finish(req, None, e)
                return
            self._loop_reply.finish(req, result, None)

        self._loop.create_task(run())

    # life cycle -----------------------------------------------------------------------

    def _init_worker(self, welcome: Welcome) -> None:
        """On the compute thread: the pipeline stage, then the worker."""
        parallel = welcome.config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        pp_rank = self.rank // tp
        sender = None
        if pp_rank < pp - 1:
            peer = welcome.data_addresses[self.rank + tp]
            sender = PipelineSender(
                zmq.Context.instance(), peer, self.rank, welcome.run_id, keys=self._keys
            )
        previous = self.rank - tp if pp_rank > 0 else None
        if previous is not None:
            self._pp_in.admit(welcome.run_id, previous)
        self._pipeline = PipelineStage(self._pp_in, sender, previous)
        self.wrapper.update_environment(welcome.env)
        self.wrapper.init_worker(welcome.config, pipeline=self._pipeline, **self._worker_kwargs)

    def _on_init_done(self, _: Any, error: BaseException | None) -> None:
        """On the compute thread, after the worker's construction."""
        if error is not None:
            log.error("creating the worker failed: %s", error)
            self._init_error = error
        self._loop.call_soon_threadsafe(self._set_welcomed)

    def _set_welcomed(self) -> None:
        if not self._welcomed.done():
            self._welcomed.set_result(None)

    def _on_engine_lost(self, why: str) -> None:
        self._engine_lost = why
        self._leave_now(why)

    def _leave_now(self, why: str) -> None:
        """No engine to answer to, or SIGTERM: the socket files go (the engine's too when
        it is gone: it cannot remove its own), and the process exits."""
        log.warning("exiting at once: %s", why)
        paths = [self._pp_in.address]
        if self._engine_lost:
            paths.append(self.engine_address)
        fast_exit(paths)

    def _watch_calls(self) -> None:
        """Every WATCH_EVERY_S on the loop: a call that runs long has every thread's stack
        written to stderr, once."""
        started = self._compute.busy_since
        if (
            started is not None
            and started != self._dumped_for
            and time.monotonic() - started > STACK_DUMP_AFTER_S
        ):
            self._dumped_for = started
            log.warning(
                "a call has run for %.0f s; every thread's stack follows",
                time.monotonic() - started,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if not self._stopped.is_set():
            self._loop.call_later(WATCH_EVERY_S, self._watch_calls)

    def _stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        self._stopped.set()
        if not self._welcomed.done():
            self._welcomed.cancel()

    async def _close(self) -> None:
        worker = self.wrapper.worker
        if worker is not None:  # shut down already after a shutdown call: then a no-op
            try:
                await asyncio.wait_for(
                    self._loop.run_in_executor(self._side, worker.shutdown), SHUTDOWN_TIMEOUT_S
                )
            except Exception:
                log.exception("worker shutdown failed")
        self._watch.close()
        self._sock.close()
        self._pp_in.close()
        if self._pipeline is not None:  # its sender is the compute thread's: closed there
            self._compute.submit(self._pipeline.close, lambda *_: None)
        self._compute.stop()
        # Joined before the interpreter exits: a thread still inside torch or libzmq
        # while the process tears down its C++ state can abort it. Briefly: a step
        # still running is abandoned, so that a worker whose engine died exits soon.
        if not self._compute.join(COMPUTE_JOIN_S):
            log.warning("exiting while the compute thread is still busy")
        self._side.shutdown(wait=False, cancel_futures=True)
        if self._zap is not None:
            self._zap.stop()
        if self._engine_lost:
            remove_socket_file(self.engine_address)
