"""The worker process: one rank, one DEALER socket to the engine, one event loop.

The loop owns the socket: it decodes requests, hands model work to the compute thread
(calls run in arrival order), answers health checks on a side thread (so they are
answered while a long step runs), and sends each reply as soon as its result is ready,
an AsyncModelRunnerOutput once its device-to-host copy is done. While the compute thread
has nothing to do, it waits on the socket itself (compute_thread.py): a call that finds
it idle is received, run and answered there, with no hand-off between threads; anything
else it receives goes on to the loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import zmq

from messages import (
    PROTOCOL_VERSION,
    Decoder,
    Encoder,
    Hello,
    IntermediateTensors,
    ProtocolError,
    RemoteError,
    RpcReply,
    RpcRequest,
    Welcome,
)
from zmqworker.distributed.pp_channel import PipelineReceiver, PipelineSender
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.runtime.async_socket import AsyncSocket
from zmqworker.runtime.compute_thread import ComputeThread, Job
from zmqworker.runtime.engine_watch import EngineWatch
from zmqworker.worker.wrapper import WorkerWrapper

log = logging.getLogger("zmqworker.worker")

HANDSHAKE_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 10.0
COMPUTE_JOIN_S = 1.0  # how long an exiting worker lets its compute thread finish
PROTOCOL_ERROR_CALL_ID = -1  # the call id of a reply to a message that did not decode
SIDE_METHODS = frozenset({"check_health"})  # answered beside the compute thread
LOOP_METHODS = SIDE_METHODS | {"shutdown"}  # handled by the loop, never the compute thread


class WorkerServer:
    def __init__(
        self,
        engine_address: str,
        rank: int,
        token: str,
        parent_pid: int | None = None,
        data_bind: str | None = None,
        wrapper: WorkerWrapper | None = None,
        handle_signals: bool = True,
    ) -> None:
        """wrapper: a WorkerWrapper whose worker may already exist (a Ray actor builds
        it through Ray before the server starts); then the Welcome's configuration is
        not applied again. handle_signals: SIGTERM/SIGINT stop the server (main thread
        only)."""
        self.engine_address = engine_address
        self.rank = rank
        self.token = token
        self.parent_pid = parent_pid
        self.data_bind = data_bind or default_data_bind(engine_address, rank)
        self.protocol_errors = 0
        self.wrapper = wrapper or WorkerWrapper(rpc_rank=rank)
        self.handle_signals = handle_signals
        self._dec = Decoder()
        self._idle_dec = Decoder()  # the compute thread's, for what it receives while idle
        self._loop_reply: Replier | None = None
        self._compute_reply: Replier | None = None
        self._side = ThreadPoolExecutor(2, thread_name_prefix=f"side-{rank}")
        self._init_error: BaseException | None = None
        self._welcome_taken = False  # set by whichever thread receives the Welcome
        self._engine_lost = ""
        self._stage: tuple[int, int] = (0, 1)  # (pp_rank, tp_size) once welcomed
        self._pp_in: PipelineReceiver | None = None
        self._pp_out: PipelineSender | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._welcomed: asyncio.Future[None] = loop.create_future()
        self._stopped = asyncio.Event()
        ctx = zmq.Context.instance()
        self._pp_in = PipelineReceiver(ctx, self.data_bind, self.rank)
        self._pp_in.start(loop)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.engine_address)
        # Before the compute thread exists: it uses the socket as soon as it starts.
        watch = EngineWatch(sock, loop, self._on_engine_lost, self.parent_pid)
        self._sock = AsyncSocket(sock, loop, self._on_message)
        self._loop_reply = Replier(self.rank, self._sock.send)
        # The compute thread leads or settles after each reply (compute_thread.py).
        self._compute_reply = Replier(self.rank, self._sock.send_before_lead)
        self._compute = ComputeThread(f"compute-{self.rank}", self._sock, self._on_idle_message)
        if self.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop, f"signal {sig.name}")
        try:
            self._sock.send(self._loop_reply.enc.encode(self._hello()))
            try:
                await asyncio.wait_for(self._welcomed, HANDSHAKE_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.error(
                    "no Welcome from %s within %.0f s", self.engine_address, HANDSHAKE_TIMEOUT_S
                )
                return 3
            except asyncio.CancelledError:
                return 0  # stopped (signal, engine gone) before the handshake finished
            await self._stopped.wait()
            return 0
        finally:
            await self._shutdown_worker()
            watch.close()
            self._sock.close()
            self._pp_in.close()
            if self._pp_out is not None:  # the compute thread owns it: closed there
                self._compute.submit(self._pp_out.close, lambda *_: None)
            self._compute.stop()
            # Joined before the interpreter exits: a thread still inside torch or libzmq
            # while the process tears down its C++ state can abort it. Briefly: a step
            # still running is abandoned, so that a worker whose engine died exits soon.
            if not self._compute.join(COMPUTE_JOIN_S):
                log.warning("exiting while the compute thread is still busy")
            self._side.shutdown(wait=False, cancel_futures=True)
            if self._engine_lost:
                _remove_engine_socket(self.engine_address)

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
        try:
            msg = self._dec.decode(frames)
        except ProtocolError as e:
            self.protocol_errors += 1
            log.warning("dropped a message that did not decode: %s", e)
            self._loop_reply.error(_peek_call_id(frames), e)
            return
        self._on_decoded(msg)

    def _on_decoded(self, msg: Any) -> None:
        if isinstance(msg, RpcRequest):
            self._dispatch(msg)
        elif isinstance(msg, Welcome) and not self._welcome_taken:
            # Queued on the compute thread first, so it runs before any call that follows.
            self._compute.submit(*self._welcome_job(msg))
        else:
            self.protocol_errors += 1
            log.warning("unexpected %s message dropped", type(msg).__name__)

    def _on_idle_message(self, frames: list[zmq.Frame]) -> Job | None:
        """On the compute thread, which received this while it had nothing to do: a call
        that belongs on it is its job now; anything else goes to the loop."""
        try:
            msg = self._idle_dec.decode(frames)
        except ProtocolError:
            self._loop.call_soon_threadsafe(self._on_message, frames)
            return None
        if isinstance(msg, Welcome) and not self._welcome_taken:
            return self._welcome_job(msg)  # here, so that it runs before the calls after it
        if not isinstance(msg, RpcRequest) or msg.method in LOOP_METHODS:
            self._loop.call_soon_threadsafe(self._on_decoded, msg)
            return None
        if self._refused(msg, self._compute_reply):
            return None
        return self._job(msg)

    def _welcome_job(self, welcome: Welcome) -> Job:
        self._welcome_taken = True
        return lambda: self._init_worker(welcome), self._on_init_done

    def _dispatch(self, req: RpcRequest) -> None:
        if self._refused(req, self._loop_reply):
            return
        if req.method == "shutdown":
            self._loop.create_task(self._shutdown_call(req))
        elif req.method in SIDE_METHODS:
            self._loop.create_task(self._serve_beside(req))
        else:
            self._compute.submit(*self._job(req))

    def _refused(self, req: RpcRequest, reply: Replier) -> bool:
        """Answer with an error a call that may not run."""
        if req.method not in self.wrapper.rpc_methods:
            reply.error(req.call_id, AttributeError(f"{req.method!r} is not callable over RPC"))
        elif req.deadline and time.time() > req.deadline:
            reply.error(req.call_id, TimeoutError(f"{req.method} arrived after its deadline"))
        else:
            return False
        if req.method == "execute_model" and self._stage[0] > 0:
            self._pp_in.forget(req.call_id)  # its tensors (and their ring slot) go back
        return True

    def _job(self, req: RpcRequest) -> Job:
        """The compute thread's work for a call: run it, then pass its result on."""
        extra = {}
        pp_rank, tp = self._stage
        if req.method == "execute_model" and pp_rank > 0:
            # Posted now, before the step is prepared; waited for only when needed.
            extra["intermediate_tensors"] = self._pp_in.expect(req.call_id, self.rank - tp)
        return partial(self._call, req, extra), partial(self._on_computed, req)

    def _call(self, req: RpcRequest, extra: dict[str, Any] | None = None) -> Any:
        if self._init_error is not None:
            raise RuntimeError(f"the worker could not be created: {self._init_error}")
        kwargs = {**req.kwargs, **extra} if extra else req.kwargs
        return self.wrapper.execute_method(req.method, *req.args, **kwargs)

    def _on_computed(self, req: RpcRequest, result: Any, error: BaseException | None) -> None:
        """On the compute thread: pass a stage's tensors on, reply at once unless an
        output still awaits its copy."""
        if req.method == "execute_model" and self._stage[0] > 0:  # a stage that receives
            self._pp_in.forget(req.call_id)
        elif req.method == "compile_or_warm_up_model" and error is None:
            _freeze_startup_heap()
        if isinstance(result, IntermediateTensors) and error is None:
            try:
                self._pp_out.send(req.call_id, result)
                result = None
            except Exception as e:
                result, error = None, e
        if isinstance(result, AsyncModelRunnerOutput):
            if not result.is_ready():
                self._loop.call_soon_threadsafe(self._await_copy, req, result)
                return
            result = result.get_output()
        self._compute_reply.finish(req, result, error)

    def _await_copy(self, req: RpcRequest, pending: AsyncModelRunnerOutput) -> None:
        self._loop.create_task(self._run_beside(req, pending.get_output))

    async def _serve_beside(self, req: RpcRequest) -> None:
        await self._run_beside(req, lambda: self._call(req))

    async def _run_beside(self, req: RpcRequest, fn: Callable[[], Any]) -> None:
        try:
            result = await self._loop.run_in_executor(self._side, fn)
        except Exception as e:
            self._loop_reply.finish(req, None, e)
            return
        self._loop_reply.finish(req, result, None)

    # life cycle -----------------------------------------------------------------------

    def _init_worker(self, welcome: Welcome) -> None:
        parallel = welcome.config.parallel
        world, tp = parallel.world_size, parallel.tensor_parallel_size
        if self.wrapper.worker is None:
            envs: list[dict[str, str]] = [{} for _ in range(world)]
            envs[self.rank] = dict(welcome.env)
            self.wrapper.update_environment_variables(envs)
            self.wrapper.init_worker([{"config": welcome.config, "rank": r} for r in range(world)])
        pp_rank = self.rank // tp
        if pp_rank < parallel.pipeline_parallel_size - 1:
            peer = welcome.data_addresses[self.rank + tp]
            self._pp_out = PipelineSender(zmq.Context.instance(), peer, self.rank)
        self._stage = (pp_rank, tp)

    def _on_init_done(self, _: Any, error: BaseException | None) -> None:
        """On the compute thread, after the worker's construction."""
        if error is not None:
            log.error("creating the worker failed: %s", error)
            self._init_error = error
        self._loop.call_soon_threadsafe(self._set_welcomed)

    def _set_welcomed(self) -> None:
        if not self._welcomed.done():
            self._welcomed.set_result(None)

    async def _shutdown_call(self, req: RpcRequest) -> None:
        await self._shutdown_worker()
        self._loop_reply.finish(req, None, None)
        self._stop("shutdown requested")

    async def _shutdown_worker(self) -> None:
        worker = self.wrapper.worker
        if worker is None:
            return
        try:
            await asyncio.wait_for(
                self._loop.run_in_executor(self._side, worker.shutdown), SHUTDOWN_TIMEOUT_S
            )
        except Exception:
            log.exception("worker shutdown failed")

    def _on_engine_lost(self, why: str) -> None:
        self._engine_lost = why
        self._stop(why)

    def stop_threadsafe(self, why: str) -> None:
        """Stop the server from another thread (a Ray actor's shutdown)."""
        self._loop.call_soon_threadsafe(self._stop, why)

    def _stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        self._stopped.set()
        if not self._welcomed.done():
            self._welcomed.cancel()


class Replier:
    """Encodes and sends replies for one thread (an Encoder is not thread-safe)."""

    def __init__(self, rank: int, send: Callable[[list], None]) -> None:
        self.rank = rank
        self.enc = Encoder()
        self._send = send

    def finish(self, req: RpcRequest, result: Any, error: BaseException | None) -> None:
        """Every failure goes back to the engine, whatever reply_rank says."""
        if error is not None:
            self.error(req.call_id, error)
            return
        if req.reply_rank is not None and req.reply_rank != self.rank:
            return
        try:
            frames = self.enc.encode(RpcReply(req.call_id, self.rank, result))
        except Exception as e:  # TypeError, ValueError, OverflowError (ints past 64 bits)...
            why = f"the result ({type(result).__name__}) cannot be encoded: {e}"
            self.error(req.call_id, TypeError(why))
            return
        self._send(frames)

    def error(self, call_id: int, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
        error = RemoteError(
            rank=self.rank, exc_type=type(exc).__name__, message=str(exc), traceback=tb
        )
        self._send(self.enc.encode(RpcReply(call_id=call_id, rank=self.rank, error=error)))


def _freeze_startup_heap() -> None:
    """Start-up is over: what it made (modules, the model, its config and tokenizer
    files) lives as long as the process. Out of the collector's sight, a full collection
    no longer walks it: 135-140 ms with the embedded model, about 0 frozen, paid by
    whichever step it falls on."""
    gc.collect()
    gc.freeze()


def _peek_call_id(frames: list[zmq.Frame]) -> int:
    """The call id of a request that did not decode, when its body still says it, so
    that the engine fails that call at once instead of waiting for its deadline."""
    try:
        body = msgspec.msgpack.decode(frames[0].bytes)
        call_id = body[1]["call_id"]
    except Exception:
        return PROTOCOL_ERROR_CALL_ID
    return (
        call_id
        if isinstance(call_id, int) and not isinstance(call_id, bool)
        else PROTOCOL_ERROR_CALL_ID
    )


def default_data_bind(engine_address: str, rank: int) -> str:
    """Where the pipeline receiver binds: beside the engine's ipc socket, or on the
    interface that reaches the engine's tcp host."""
    if engine_address.startswith("ipc://"):
        folder = Path(engine_address[len("ipc://") :]).parent
        return f"ipc://{folder}/data-{rank}-{os.getpid()}.sock"
    host = engine_address[len("tcp://") :].rsplit(":", 1)[0]
    return f"tcp://{_local_ip_towards(host)}:*"


def _local_ip_towards(host: str) -> str:
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


def _remove_engine_socket(address: str) -> None:
    """An engine killed outright cannot remove its ipc socket file: its workers do."""
    if not address.startswith("ipc://"):
        return
    path = Path(address[len("ipc://") :])
    for remove in (path.unlink, path.parent.rmdir):
        try:
            remove()
        except OSError:
            continue  # another worker removed it first, or the folder still holds files
