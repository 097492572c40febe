"""One API server process of `zmqworker serve`: `python -m zmqworker.serve.api_server`,
spawned by the serve command's main process (whose pid is its one argument), its
ApiServerConfig on its stdin.

It loads the model's text side, connects to the engine cores the main process started
(a client of each, watching each through a pidfd of its own), and runs uvicorn on uvloop
over the listening socket it inherited: every API server accepts on the same port. It
exits with its parent (PR_SET_PDEATHSIG; at once if its parent is no longer that pid),
and with status 1 once it has lost an engine core its parent has not (an engine core
drops a client that went silent, one stopped or paused past its bound): the parent then
stops the whole server, as for any part that dies;
SIGTERM drains it (uvicorn stops taking
connections and lets the requests in flight finish, at most shutdown_timeout_s, then
answers those left with a 503 or ends their streams with an error); SIGUSR1 is the
main process's word that part of the server died: what runs is answered at once, with
the error its stop file names, and it exits; SIGINT is the main process's to handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

import msgspec
import uvicorn

from zmqworker.engine.model_folder import ModelFolder
from zmqworker.frontend.core_process import WatchedEngineCore
from zmqworker.frontend.disaggregated_client import client_maker
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.remote_cores import remote_client
from zmqworker.runtime.parent_death import (
    PARENT_DEATH_SIGNAL,
    follow_spawner,
    release_parent_death,
)
from zmqworker.serve.app import build_app
from zmqworker.serve.cors import CorsOptions
from zmqworker.serve.errors import APIError
from zmqworker.serve.tools import ToolOptions

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 3600.0  # the engine cores start beside it: their workers, warm-up


# After the drain's deadline, how long the requests it ended have to answer.
ANSWER_S = 2.0
# How long it waits, once it lost an engine core, for its parent's word (SIGUSR1, when
# the parent saw that engine core end too: its error names what died) before it exits.
LOST_WAIT_S = 2.0


class ApiServerConfig(msgspec.Struct, frozen=True):
    """What the main process hands an API server (on its stdin: the API key and the
    engine cores' token never show in ps)."""

    index: int
    model: str  # the checkpoint folder, for the tokenizer and generation defaults
    served_model_name: str
    api_key: str | None
    engine_addresses: list[str]
    engine_pids: list[int] | None  # None: engine cores served on their own (remote_cores.py)
    token: str
    max_logprobs: int
    output_bytes: int
    listen_fd: int
    shutdown_timeout_s: float
    max_request_bytes: int
    enable_admin_endpoints: bool
    cors: CorsOptions | None
    tool_call_parser: str | None  # "auto" tool choice's parser (None: refused)
    disaggregated: bool  # the engine cores are prefill and decode instances
    max_local_prefill_tokens: int | None  # disaggregated: the router's (DisaggregatedClient)
    log_level: str  # uvicorn's
    stop_file: str  # what died, written there by the main process before its SIGUSR1
    engine_log_level: str  # the zmqworker logger's


def connect(config: ApiServerConfig) -> Frontend:
    """A client of the engine cores, once each is ready, with the model's text side."""
    folder = ModelFolder.open(config.model)
    texts = folder.load_text_side()
    if config.engine_pids is None:
        client = remote_client(config.engine_addresses, config.token, config.disaggregated,
                               config.index, config.max_local_prefill_tokens)  # fmt: skip
    else:
        handles = [WatchedEngineCore(i, pid) for i, pid in enumerate(config.engine_pids)]
        make = client_maker(config.disaggregated, config.max_local_prefill_tokens)
        client = make(
            config.engine_addresses, handles, config.token, config.index, config.output_bytes
        )
    try:
        readies = client.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        client.close()
        raise
    return Frontend(client, readies, texts, folder, config.max_logprobs, config.index)


def run(config: ApiServerConfig) -> int:
    frontend = connect(config)
    try:
        server = _Server(
            frontend,
            config.shutdown_timeout_s,
            config.stop_file,
            uvicorn.Config(
                build_app(
                    frontend,
                    config.served_model_name,
                    config.api_key,
                    config.max_request_bytes,
                    config.enable_admin_endpoints,
                    config.cors,
                    ToolOptions(config.tool_call_parser),
                ),
                loop="uvloop",
                timeout_graceful_shutdown=config.shutdown_timeout_s + ANSWER_S,
                log_level=config.log_level,
                access_log=config.log_level in ("debug", "info"),
            ),
        )
        server.run(sockets=[socket.socket(fileno=config.listen_fd)])
        return 0 if server.started and server.lost is None else 1
    finally:
        frontend.close()


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM ends run() instead of the process (uvicorn
    raises the signal again once it has shut down, which would skip closing the client),
    and that the requests still running at the drain's deadline end with an error their
    handlers answer (a 503, or an error event then [DONE]): uvicorn cancels what runs
    past its own timeout, and a cancelled handler answers a bare 500 or cuts its stream."""

    def __init__(
        self, frontend: Frontend, drain_s: float, stop_file: str, config: uvicorn.Config
    ) -> None:
        super().__init__(config)
        self._frontend = frontend
        self._drain_s = drain_s
        self._stop_file = stop_file
        self._failed_now = False
        self._lost_at: float | None = None
        self.lost: Exception | None = None  # the engine core loss it exits for

    async def on_tick(self, counter: int) -> bool:
        """Exit (status 1) LOST_WAIT_S after losing an engine core, unless told first."""
        lost = self._frontend.lost
        if lost is not None and not self.should_exit:
            now = time.monotonic()
            if self._lost_at is None:
                self._lost_at = now
            if now - self._lost_at >= LOST_WAIT_S:
                logger.error("API server: the server stops: %s", lost)
                self.lost = lost
                self._fail_now(f"the server stops: {lost}")
        return await super().on_tick(counter)

    def _on_usr1(self) -> None:
        """SIGUSR1 (on the loop): fail everything with the stop file's reason."""
        try:
            with open(self._stop_file) as f:
                reason = f.read().strip() or "the server stops"
        except OSError:
            reason = "the server stops"
        self._fail_now(reason)

    def _fail_now(self, reason: str) -> None:
        """Answer everything with reason (a 503), and exit."""
        self._frontend.fail_all(APIError(reason, 503, "server_error"))
        self._failed_now = True  # the drain's own deadline has nothing left to end
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stopping = APIError(
            f"the server is shutting down: the request ran past its {self._drain_s:g} s "
            "drain (--shutdown-timeout)",
            503,
            "server_error",
        )
        deadline = asyncio.get_running_loop().call_later(
            math.inf if self._failed_now else self._drain_s, self._frontend.fail_all, stopping
        )
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        usr1 = signal.signal(signal.SIGUSR1, lambda *_: loop.call_soon_threadsafe(self._on_usr1))
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGUSR1, usr1)


def main() -> int:
    try:
        config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ApiServerConfig)
    except msgspec.DecodeError as exc:
        print(f"zmqworker api server: error: stdin: {exc}", file=sys.stderr)
        return 2
    if not follow_spawner(sys.argv):
        return 0
    signal.signal(PARENT_DEATH_SIGNAL, lambda *_: os._exit(0))  # the main process is gone
    release_parent_death()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=config.engine_log_level, format="%(message)s")
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
