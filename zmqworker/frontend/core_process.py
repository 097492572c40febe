"""The engine cores a client starts, and how it watches them.

An engine core is a process (`python -m zmqworker.engine`, its EngineCoreConfig on its
stdin), spawned from a thread that lives as long as it is wanted: its parent-death
signal follows that thread. Its ROUTER's socket file lives in a folder of the launcher's
(mode 0700: only this user can connect). For tests, an executor made in this process (a
factory, not a name) runs its engine core in a thread of this process instead, serving
the same protocol on the same kind of socket: the client code is the same.

A handle gives the client a file descriptor that becomes readable once its engine core is
gone (a pidfd, or a pipe the thread writes as it ends), and says how it went.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import Any

import zmq

from messages import EngineCoreConfig
from zmqworker.executor.errors import describe_exit
from zmqworker.executor.process import ChildProcess, spawn_all
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.frontend")

EXIT_GRACE_S = 30.0  # after its shutdown call: the engine core stops its workers first
SIGTERM_GRACE_S = 3.0


class EngineCoreHandle(ABC):
    index: int
    pid: int
    owned = True  # this client started it, and stops it (shut_down_engines)

    @property
    def label(self) -> str:
        """How errors name it after "engine core N"."""
        return f"(pid {self.pid})"

    @property
    @abstractmethod
    def death_fd(self) -> int:
        """Readable once the engine core is gone."""

    @abstractmethod
    def how_it_ended(self) -> str:
        """What is known of its end, for an error message ("died (exit status 1)...")."""

    @abstractmethod
    def close(self) -> None:
        """Release the handle's file descriptors (after stop)."""


class EngineCoreProcess(EngineCoreHandle):
    def __init__(self, index: int, config: bytes, env: dict[str, str] | None = None) -> None:
        self.index = index
        argv = [sys.executable, "-m", "zmqworker.engine", str(os.getpid())]  # its spawner
        environ = {**os.environ, **(env or {})}
        self.proc = ChildProcess(f"engine core {index}", argv, environ, stdin=config)
        self.pid = self.proc.pid
        if self.proc.pidfd is None:
            raise OSError("watching an engine core needs pidfd_open (Linux 5.3 or later)")
        self._pidfd = self.proc.pidfd

    @property
    def death_fd(self) -> int:
        return self._pidfd

    def how_it_ended(self) -> str:
        self.proc.wait(1.0)  # its pidfd fired: it is about to be reaped
        status = self.proc.exit_status()
        how = "unknown exit status" if status is None else describe_exit(status)
        text = f"(pid {self.pid}) died ({how})"
        tail = self.proc.stderr_tail().strip()
        if tail:
            text += f"; its last stderr lines:\n{tail}"
        return text

    def stop(self, grace_s: float) -> None:
        """Wait grace_s for it to end (after its shutdown call), then SIGTERM, SIGKILL."""
        self.proc.stop(grace_s=grace_s, term_s=SIGTERM_GRACE_S)

    def close(self) -> None:
        self.proc.close()


class EngineCoreThread(EngineCoreHandle):
    """An engine core served by a thread of this process (an executor made here)."""

    def __init__(self, index: int, run: Callable[[], Any]) -> None:
        self.index = index
        self.pid = os.getpid()
        self._ended = WakePipe()
        self._error: BaseException | None = None

        def serve() -> None:
            try:
                run()
            except BaseException as exc:  # reported through how_it_ended
                self._error = exc
            finally:
                self._ended.wake()

        self._thread = threading.Thread(target=serve, name=f"engine-core-{index}", daemon=True)
        self._thread.start()

    @property
    def death_fd(self) -> int:
        return self._ended.fd

    def how_it_ended(self) -> str:
        self._thread.join(1.0)
        if self._error is None:
            return "(a thread) ended"
        return f"(a thread) ended with {type(self._error).__name__}: {self._error}"

    def stop(self, grace_s: float) -> None:
        self._thread.join(max(grace_s, SIGTERM_GRACE_S))  # a thread cannot be ended harder
        if self._thread.is_alive():
            log.error("engine core %d (a thread) did not stop", self.index)

    def close(self) -> None:
        self._ended.close()


class WatchedEngineCore(EngineCoreHandle):
    """An engine core another process started (an API server's view): watched through a
    pidfd of its own; its exit status is its parent's to know."""

    def __init__(self, index: int, pid: int) -> None:
        self.index = index
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)

    @property
    def death_fd(self) -> int:
        return self._pidfd

    def how_it_ended(self) -> str:
        return f"(pid {self.pid}) exited"

    def close(self) -> None:
        os.close(self._pidfd)


class RemoteEngineCore(EngineCoreHandle):
    """An engine core served on its own (`zmqworker engine-core`, on another host or
    this one): this client cannot watch its process, so its end is known from its
    connection alone (heartbeats), and it is not this client's to stop."""

    owned = False

    def __init__(self, index: int, address: str) -> None:
        self.index = index
        self.pid = 0  # on another host, maybe: its EngineCoreReady says
        self.address = address
        self._never = WakePipe()  # a death fd that never fires

    @property
    def label(self) -> str:
        return f"at {self.address}"

    @property
    def death_fd(self) -> int:
        return self._never.fd

    def how_it_ended(self) -> str:
        return f"{self.label} ended"

    def close(self) -> None:
        self._never.close()


class EngineCoreLauncher:
    """Starts one engine core per config (a data-parallel replica each) and owns them
    until stop(): their socket folder, the spawning thread, the handles. configs are
    made by make_config(index, address, token); env: variables the engine core processes
    (and their workers) get beside this process's."""

    def __init__(
        self,
        num_engines: int,
        make_config: Callable[[int, str, str], EngineCoreConfig],
        make_executor: Callable[[Any], Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        from messages import Encoder
        from zmqworker.executor.handshake import new_token

        self.folder = tempfile.mkdtemp(prefix="zmqworker-core-")  # 0700: only this user
        self.token = new_token()
        self.addresses = [f"ipc://{self.folder}/engine-core-{i}.sock" for i in range(num_engines)]
        configs = [make_config(i, a, self.token) for i, a in enumerate(self.addresses)]
        self.handles: list[EngineCoreProcess | EngineCoreThread] = []
        self._spawner = threading.Event()  # set: the spawning thread may end
        self._finalizer = weakref.finalize(self, _kill_all, self.handles, self.folder)
        try:
            if make_executor is None:
                encoder = Encoder()
                makers = [
                    functools.partial(
                        EngineCoreProcess, c.engine_index, bytes(encoder.encode(c)[0]), env
                    )
                    for c in configs
                ]
                spawn_all(makers, self.handles, self._spawner)
            else:
                for config in configs:
                    self.handles.append(
                        EngineCoreThread(
                            config.engine_index, _serve_in_thread(config, make_executor)
                        )
                    )
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [h.pid for h in self.handles]

    def stop(self, leaving: Collection[int] = ()) -> None:
        """Let the engine cores of leaving (they answered their shutdown call) end within
        EXIT_GRACE_S, end the others and the late ones harder (SIGTERM, then SIGKILL),
        and remove the socket folder. Idempotent."""
        if not self._finalizer.alive:
            return
        for handle in self.handles:
            handle.stop(EXIT_GRACE_S if handle.index in leaving else 0.0)
        for handle in self.handles:
            handle.close()
        self._spawner.set()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._finalizer.detach()


def _serve_in_thread(
    config: EngineCoreConfig, make_executor: Callable[[Any], Any]
) -> Callable[[], int]:
    def run() -> int:
        from zmqworker.engine.core_main import build_core
        from zmqworker.engine.core_server import EngineCoreServer

        ctx = zmq.Context()
        server = EngineCoreServer(config, ctx)
        try:
            return server.serve(lambda: build_core(config, make_executor))
        finally:
            server.close()
            ctx.term()

    return run


def _kill_all(handles: list[EngineCoreProcess | EngineCoreThread], folder: str) -> None:
    """Last resort at exit or collection, for a launcher nobody stopped: SIGTERM (the
    engine core leaves at once; its workers follow)."""
    for handle in handles:
        if isinstance(handle, EngineCoreProcess):
            try:
                handle.proc.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                continue
            handle.proc.wait(SIGTERM_GRACE_S)
    shutil.rmtree(folder, ignore_errors=True)
