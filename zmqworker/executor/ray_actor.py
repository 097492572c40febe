"""One rank as a Ray actor: a WorkerWrapper that Ray places, and the same WorkerServer a
worker process runs, serving the engine over ZMQ.

Ray calls (the control plane) reach the actor only at start-up and shutdown: where it
runs, its rank and environment, its worker's class (checked at once) and constructor
arguments, starting and stopping its server. They carry plain values; the WorkerConfig
crosses as msgspec bytes. The server builds the worker when the engine's Welcome comes,
as in a worker process. Every step message comes over the server's DEALER socket (the
data plane), as with MultiprocExecutor.

The actor runs with max_concurrency > 1, so wait_server can stay open for the whole
life of the server (the executor watches it to learn of deaths) while other calls
still get through.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Any

import msgspec
import ray

from messages import WorkerConfig
from zmqworker.transport.curve import WorkerKeys
from zmqworker.transport.spawn_env import message_bounds
from zmqworker.worker.wrapper import worker_class


class RayWorkerActor:
    def __init__(self) -> None:
        # The rank comes once the executor has seen where every actor landed.
        self.rank: int | None = None
        self._worker_kwargs: dict[str, Any] = {}
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._exit_code: int | None = None
        self._error: BaseException | None = None

    def placement(self) -> dict[str, Any]:
        """Where this actor runs: node id and IP, the GPUs Ray gave it, its pid."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A free TCP port on this node, for torch.distributed's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def assign_rank(self, rank: int) -> None:
        if self.rank is not None:
            raise RuntimeError(f"the actor has rank {self.rank} already")
        self.rank = rank

    def update_environment(self, env: dict[str, str]) -> None:
        """This rank's environment (CUDA_VISIBLE_DEVICES, ...), before any worker exists."""
        self._rank()
        os.environ.update({key: str(value) for key, value in env.items()})

    def prepare_worker(self, config: bytes, kwargs: dict[str, Any]) -> None:
        """Check the worker class that config (a msgspec-encoded WorkerConfig) names, so
        that a bad one fails the start-up here, and keep the worker's other constructor
        arguments (local_rank, ...) for the server, which builds it."""
        self._rank()
        worker_class(msgspec.msgpack.decode(config, type=WorkerConfig))
        self._worker_kwargs = dict(kwargs)

    def start_server(
        self,
        engine_address: str,
        token: str,
        data_bind: str,
        curve_keys: str,
        message_limits: str,
        welcome_timeout_s: float,
        engine_silent_s: float | None,
    ) -> None:
        """Start the WorkerServer in a thread of its own; it connects to the engine's
        ROUTER and says hello. Returns once stop_server can reach it. curve_keys: the
        run's WorkerKeys as their environment value ("" for none); message_limits: the
        frame bounds as $ZMQWORKER_MAX_MESSAGE_BYTES says them. welcome_timeout_s: how
        long the server waits for its Welcome after its Hello (the engine's start-up
        bound and a margin, as a worker process's); engine_silent_s: the engine's stuck
        bound, after which the server leaves an engine answering none of its pings (None:
        it pings not)."""
        from zmqworker.runtime.worker_process import WorkerServer  # torch: only once placed

        rank = self._rank()
        keys = WorkerKeys.parse(curve_keys) if curve_keys else None
        max_request, max_pipeline, max_reply = message_bounds(message_limits)
        if self._thread is not None:
            raise RuntimeError(f"rank {rank}: the server runs already")
        self._loop = _new_event_loop()
        self._server = WorkerServer(
            self._loop,
            engine_address,
            rank,
            token,
            data_bind=data_bind,
            worker_kwargs=self._worker_kwargs,
            handle_signals=False,
            keys=keys,
            max_request_bytes=max_request,
            max_pipeline_bytes=max_pipeline,
            max_reply_bytes=max_reply,
            welcome_timeout_s=welcome_timeout_s,
            engine_silent_s=engine_silent_s,
        )
        # Queued before any stop request can be: the server's first step runs first.
        task = self._loop.create_task(self._server.run())
        self._thread = threading.Thread(
            target=self._serve, args=(task,), name=f"server-{rank}", daemon=True
        )
        self._thread.start()

    def wait_server(self) -> int:
        """Returns the server's exit code when it stops; open as long as it serves."""
        if self._thread is None:
            raise RuntimeError("wait_server before start_server")
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._exit_code if self._exit_code is not None else 1

    def stop_server(self, why: str) -> None:
        """Ask the server to stop; wait_server then returns."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            self._server.stop_threadsafe(why)
        except RuntimeError:  # the loop closed meanwhile: the server stopped by itself
            return

    def _serve(self, task: asyncio.Task) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            self._exit_code = loop.run_until_complete(task)
        except BaseException as e:  # reported by wait_server
            self._error = e
        finally:
            loop.close()

    def _rank(self) -> int:
        if self.rank is None:
            raise RuntimeError("the actor has no rank yet (assign_rank)")
        return self.rank


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform; asyncio serves as well
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
