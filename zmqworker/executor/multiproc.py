"""MultiprocExecutor: tp x pp worker subprocesses on this machine, over one ROUTER socket.

Start-up: bind the ROUTER (ipc:// in a private folder, or tcp:// with CURVE), spawn the
workers, wait for every Hello (within start_timeout, which the workers' wait for their
Welcome follows; a rank that dies, or stays stopped for stuck_after_s, fails it at once),
answer each with its Welcome, then init_device and load_model on all. Any failure stops
every worker and raises WorkerStartupError naming the failing rank, with its error and
the tail of its stderr.

Workers are spawned from a thread of the executor's own that lives as long as it: a
worker's parent-death signal (it exits when its engine does, SIGKILL included) follows
the thread that spawned it, not the process.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from contextlib import ExitStack
from typing import Any

import msgspec
import zmq

from messages import WorkerConfig
from zmqworker.executor.abstract import Executor
from zmqworker.executor.calls import Liveness
from zmqworker.executor.errors import (
    ExecutorError,
    WorkerDiedError,
    WorkerStartupError,
)
from zmqworker.executor.handshake import (
    STUCK_AFTER_S,
    WELCOME_MARGIN_S,
    Handshake,
    bind_router,
    new_token,
    polite_shutdown,
)
from zmqworker.executor.message_limits import message_limits
from zmqworker.executor.process import WorkerProcess, spawn_all
from zmqworker.executor.rpc_client import RpcClient
from zmqworker.runtime.fast_exit import hold_folder, let_go
from zmqworker.transport.curve import CURVE_ENV, RunKeys, start_zap
from zmqworker.transport.heartbeats import check_bound
from zmqworker.transport.spawn_env import (
    ENGINE_SILENT_ENV,
    MAX_MESSAGE_ENV,
    TOKEN_ENV,
    WELCOME_TIMEOUT_ENV,
)

SHUTDOWN_GRACE_S = 5.0
SIGTERM_GRACE_S = 3.0


class _ProcessLiveness(Liveness):
    def __init__(self, procs: list[WorkerProcess]) -> None:
        super().__init__({p.pidfd: p.rank for p in procs if p.pidfd is not None})
        self.procs = procs

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()

    def stopped(self, rank: int) -> bool:
        return self.procs[rank].stopped()

    def exit_status(self, rank: int) -> int | None:
        return self.procs[rank].exit_status()

    def check(self) -> WorkerDiedError | None:
        for p in self.procs:
            status = p.exit_status()
            if status is not None:
                return WorkerDiedError(p.rank, status)
        return None


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: WorkerConfig,
        transport: str = "ipc",
        start_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        per_rank_env: list[dict[str, str]] | None = None,
        curve: bool | None = None,
        stuck_after_s: float | None = STUCK_AFTER_S,
    ) -> None:
        """curve: CURVE on every tcp socket of the run (None: on for tcp; ipc sockets live
        in a 0700 folder and never use it); False only for a network you trust.
        stuck_after_s: a worker silent for that long (stopped, wedged below Python) fails
        the calls with WorkerStuckError and is killed; None: never."""
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if curve and transport == "ipc":
            raise ValueError("curve is for tcp: ipc sockets live in a folder only you can open")
        check_bound("stuck_after_s", stuck_after_s)
        if not start_timeout > 0:
            raise ValueError(f"start_timeout must be > 0, got {start_timeout!r}")
        world = config.parallel.world_size
        if per_rank_env is not None and len(per_rank_env) != world:
            raise ValueError(f"per_rank_env has {len(per_rank_env)} entries for {world} ranks")
        if world > 1 and not config.parallel.distributed_init_method:
            parallel = msgspec.structs.replace(
                config.parallel, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}"
            )
            config = msgspec.structs.replace(config, parallel=parallel)
        limits = message_limits(config)  # first: a config it refuses leaves nothing made
        self.config = config
        self.procs: list[WorkerProcess] = []
        self._closed = False
        keys = RunKeys.new() if (curve if curve is not None else transport == "tcp") else None
        self.curve = keys is not None
        # A failure part-way (a socket path too long, a thread that cannot start) frees
        # what was made before it.
        with ExitStack() as undo:
            self._dir = tempfile.mkdtemp(prefix="zmqworker-")  # mode 0700: only this user
            hold_folder(self._dir)  # a fast exit before the workers start removes it
            undo.callback(let_go, self._dir)
            undo.callback(shutil.rmtree, self._dir, ignore_errors=True)
            self._ctx = zmq.Context()
            undo.callback(self._ctx.term)
            self._zap = start_zap(self._ctx, keys.worker_public) if keys is not None else None
            if self._zap is not None:
                undo.callback(self._zap.stop)
            endpoint = f"ipc://{self._dir}/engine.sock" if transport == "ipc" else "tcp://127.0.0.1"
            self._sock, self.address = bind_router(
                self._ctx, endpoint, limits.reply_bytes, stuck_after_s, keys
            )
            undo.pop_all()
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, self._dir)
        token = new_token()
        child_env = {**os.environ, **(env or {}), TOKEN_ENV: token}
        child_env[MAX_MESSAGE_ENV] = limits.to_env()
        child_env[WELCOME_TIMEOUT_ENV] = repr(float(start_timeout) + WELCOME_MARGIN_S)
        child_env.pop(ENGINE_SILENT_ENV, None)
        if stuck_after_s is not None:
            child_env[ENGINE_SILENT_ENV] = repr(float(stuck_after_s))
        child_env.pop(CURVE_ENV, None)
        if keys is not None:
            child_env[CURVE_ENV] = keys.for_workers().to_env()
        argv = [sys.executable, "-m", "zmqworker.runtime", "--engine", self.address]
        makers = [
            functools.partial(
                WorkerProcess,
                rank,
                [*argv, "--rank", str(rank), "--exit-with-parent", str(os.getpid())],
                child_env,
            )
            for rank in range(world)
        ]
        self._spawner = threading.Event()  # set: the spawning thread may end
        try:
            spawn_all(makers, self.procs, self._spawner)
        except BaseException:
            self._release(polite=False)
            raise
        self._liveness = _ProcessLiveness(self.procs)
        handshake = Handshake(world, token, self.pids)
        self.rpc = RpcClient(
            self._sock,
            self._liveness,
            on_other=handshake.on_hello,
            stuck_after_s=stuck_after_s,
            max_request_bytes=limits.request_bytes,
        )
        try:
            handshake.run(self.rpc, self.config, start_timeout, per_rank_env, stuck_after_s)
            self.collective_rpc("init_device", timeout=start_timeout)
            self.collective_rpc("load_model", timeout=start_timeout)
        except BaseException as e:
            error = self._startup_error(e)
            self.shutdown()
            raise error from e

    # the Executor interface ------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | list[int] | None = None,
        non_block: bool = False,
    ) -> Any:
        if self._closed:
            raise ExecutorError(f"{method}: the executor is shut down")
        return self.rpc.collective_rpc(method, args, kwargs, timeout, unique_reply_rank, non_block)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        polite = polite_shutdown(self.rpc, len(self.procs), SHUTDOWN_GRACE_S)
        self.rpc.close()  # fails what is still open; before the pidfds it watches close
        self._release(polite)

    def _release(self, polite: bool) -> None:
        """Stop the processes and free what the executor holds but the client."""
        self._closed = True
        for proc in self.procs:
            proc.stop(grace_s=SHUTDOWN_GRACE_S if polite else 0.0, term_s=SIGTERM_GRACE_S)
        for proc in self.procs:
            proc.close()
        self._spawner.set()
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        let_go(self._dir)
        self._finalizer.detach()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def failure(self) -> ExecutorError | None:
        return self.rpc.dead

    # start-up -------------------------------------------------------------------------

    def _startup_error(self, e: BaseException) -> BaseException:
        if isinstance(e, KeyboardInterrupt):
            return e
        rank = getattr(e, "rank", None)
        if rank is None:
            died = self._liveness.check()
            rank = died.rank if died else None
        text = f"worker start-up failed: {e}"
        if rank is not None and rank < len(self.procs):
            time.sleep(0.2)  # let a dying worker's last words reach the pipe
            tail = self.procs[rank].stderr_tail()
            if tail:
                text += f"\n--- stderr of rank {rank} (last lines) ---\n{tail}"
        return WorkerStartupError(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list[WorkerProcess], folder: str) -> None:
    """Last resort at exit or collection, for an executor nobody shut down."""
    for proc in procs:
        proc.stop(grace_s=0.0, term_s=SIGTERM_GRACE_S)
    shutil.rmtree(folder, ignore_errors=True)
    let_go(folder)
