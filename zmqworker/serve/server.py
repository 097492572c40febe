"""`zmqworker serve`'s main process: it plans the engine (every option checked before
anything starts), binds the port, starts the engine cores (one per data-parallel
replica) and N API server processes that accept on the same listening socket, each a
client of every engine core, and then supervises them. Disaggregated (--disaggregate),
the engine cores are prefill and decode instances, and each API server's client routes
every request through one of each (frontend/disaggregated_client.py). With
--engine-core-address it starts none: it connects to engine cores served on their own
(frontend/remote_cores.py), which it checks and watches but never stops.

Any of them dying takes the whole server down: every API server is told at once
(SIGUSR1, the reason in its stop file) to answer what it still runs with an error naming
what died (a 503, or a stream's error event and [DONE]), all within one shared deadline
before SIGKILL; then the engine cores stop, and the command fails with that error (a
server that lost part of itself would serve on degraded and unnoticed; let the
supervisor above, systemd or Kubernetes, start a whole one again). SIGINT or SIGTERM
drains: the API servers stop taking connections and let the requests in flight finish
(at most shutdown_timeout_s), then the engine cores stop their workers. Nothing this
process started is left running either way.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec

from zmqworker.executor.process import ChildProcess, spawn_all
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.disaggregated_plan import (
    DisaggregatedPlan,
    check_pair_options,
    start_engine_cores,
)
from zmqworker.frontend.engine_connection import Failed
from zmqworker.frontend.engine_plan import EnginePlan
from zmqworker.frontend.engine_shutdown import shut_down_engines
from zmqworker.frontend.llm import OPTION_DEFAULTS, OPTION_TYPES
from zmqworker.frontend.llm_args import check_args
from zmqworker.frontend.remote_cores import RemotePlan
from zmqworker.serve.api_server import READY_TIMEOUT_S, ApiServerConfig
from zmqworker.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES
from zmqworker.serve.cors import CorsOptions
from zmqworker.serve.metrics import MULTIPROC_ENV
from zmqworker.serve.sizing import default_api_server_count
from zmqworker.serve.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

WATCH_EVERY_S = 0.5  # how often the main process looks at its children
STOP_MARGIN_S = 10.0  # past the drain's bound, before an API server is stopped harder
FAIL_S = 3.0  # after a death: for the API servers to answer what they hold, then SIGKILL
STOP_FILE = "stop-reason"  # in the metrics folder (its collector reads *.db only)


def serve(
    engine_options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "warning",
    api_server_count: int | None = None,
    enable_admin_endpoints: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    cors: CorsOptions | None = None,
    tool_call_parser: str | None = None,
) -> None:
    """engine_options: the LLM's; with disaggregate, prefill and decode instances
    (disaggregated_plan.py) and the router in every API server (disaggregated_client.py)."""
    count = default_api_server_count() if api_server_count is None else api_server_count
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count}")
    if not 0 <= shutdown_timeout_s < math.inf:  # nan too: every wait has a bound
        raise ValueError(f"--shutdown-timeout must be finite and >= 0, got {shutdown_timeout_s}")
    if max_request_bytes < 1:  # before anything starts
        raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
    if cors is not None:
        cors.check()
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}"
        )
    options = {**OPTION_DEFAULTS, **engine_options}
    check_args(OPTION_TYPES, options)
    # Engine cores served on their own (remote) are connected to, never started or stopped.
    remote = (
        RemotePlan.from_options(options, OPTION_DEFAULTS)
        if options["engine_core_addresses"]
        else None
    )
    if remote is None:
        check_pair_options(options)
        plan = EnginePlan.from_options(options)
        pair = DisaggregatedPlan.from_options(plan, options)
        folder, max_logprobs, output_bytes = plan.folder, plan.max_logprobs, plan.output_bytes
    else:
        folder, max_logprobs, output_bytes = remote.folder, remote.max_logprobs, -1
    name = served_model_name or folder.path.name
    listener = _listen(host, port)  # a port in use fails here, before anything starts
    launcher, make_client = (None, None) if remote else start_engine_cores(plan, pair)
    servers: list[ChildProcess] = []
    spawner = threading.Event()  # set: the spawning thread may end
    client = None
    # The API servers' metrics files, added up at each scrape (serve/metrics.py).
    metrics_dir = tempfile.mkdtemp(prefix="zmqworker-metrics-")
    try:
        config = functools.partial(
            ApiServerConfig,
            model=str(folder.path),
            served_model_name=name,
            api_key=api_key,
            engine_addresses=remote.addresses if remote else launcher.addresses,
            engine_pids=None if remote else launcher.pids,
            token=remote.token if remote else launcher.token,
            max_logprobs=max_logprobs,
            output_bytes=output_bytes,
            listen_fd=listener.fileno(),
            shutdown_timeout_s=shutdown_timeout_s,
            max_request_bytes=max_request_bytes,
            enable_admin_endpoints=enable_admin_endpoints,
            cors=cors,
            tool_call_parser=tool_call_parser,
            disaggregated=options["disaggregate"],
            max_local_prefill_tokens=options["max_local_prefill_tokens"],
            log_level=log_level,
            stop_file=os.path.join(metrics_dir, STOP_FILE),
            engine_log_level=logging.getLevelName(logger.getEffectiveLevel()),
        )
        argv = [sys.executable, "-m", "zmqworker.serve.api_server", str(os.getpid())]
        makers = [
            functools.partial(
                ChildProcess,
                f"api server {i}",
                argv,
                {**os.environ, MULTIPROC_ENV: metrics_dir},
                stdin=msgspec.msgpack.encode(config(index=i)),
                pass_fds=(listener.fileno(),),
            )
            for i in range(count)
        ]
        spawn_all(makers, servers, spawner)
        listener.close()  # the API servers hold it now
        if remote is not None:
            client = remote.connect(count)
            remote.check_readies(client.wait_ready(READY_TIMEOUT_S))
        else:
            client = make_client(
                launcher.addresses, launcher.handles, launcher.token, count, output_bytes
            )
        url = f"http://{host}:{port}/v1"
        _Supervisor(client, servers, name, url, metrics_dir).run(shutdown_timeout_s)
    finally:
        listener.close()
        logger.info("stopping the workers")
        _stop_servers(servers, grace_s=STOP_MARGIN_S / 3)
        leaving: set[int] = set()
        if client is not None:
            leaving = shut_down_engines(client)
            client.close()
        if launcher is not None:
            launcher.stop(leaving)
        for server in servers:
            server.close()
        spawner.set()
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor:
    """Watches the engine cores (through the main process's own client) and the API
    servers until a signal asks for a drain, or one of them dies."""

    def __init__(
        self,
        client: EngineCoreClient,
        servers: list[ChildProcess],
        name: str,
        url: str,
        metrics_dir: str,
    ) -> None:
        self.client = client
        self.stop_file = os.path.join(metrics_dir, STOP_FILE)
        self.servers = servers
        self.name = name
        self.url = url
        self.signalled: int | None = None

    def run(self, shutdown_timeout_s: float) -> None:
        """Return after a drain; raise RuntimeError naming what died."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            announced = False
            while self.signalled is None:
                for event in self.client.receive(WATCH_EVERY_S):
                    if isinstance(event, Failed) and event.fatal:
                        self._died(f"the server stops: {event.error}")
                for server in self.servers:
                    if server.exit_status() is not None:
                        self._died(f"the server stops: {_ended(server)}")
                if not announced and all(e.ready for e in self.client.engines):
                    announced = True
                    logger.info(
                        "serving %s on %s: %d API server(s), %d engine core(s)",
                        self.name, self.url, len(self.servers), len(self.client.engines),
                    )  # fmt: skip
            logger.info("signal %d: draining the requests in flight", self.signalled)
            _stop_servers(self.servers, grace_s=shutdown_timeout_s + STOP_MARGIN_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = signum

    def _died(self, reason: str) -> None:
        """Have every API server answer what it holds with reason's first line (its
        clients' error), wait for them all until one deadline, SIGKILL the rest; raise."""
        try:  # without it, they answer "the server stops"
            with open(self.stop_file + ".tmp", "w") as f:
                f.write(reason.splitlines()[0].removesuffix("; its last stderr lines:"))
            os.replace(self.stop_file + ".tmp", self.stop_file)  # whole when they read it
        except OSError:
            pass
        _signal_all(self.servers, signal.SIGUSR1)
        _wait_all(self.servers, FAIL_S)
        raise RuntimeError(reason)


def _stop_servers(servers: list[ChildProcess], grace_s: float) -> None:
    """SIGTERM every API server (a drain), then wait grace_s for them all (one deadline)
    before SIGKILL."""
    _signal_all(servers, signal.SIGTERM)
    _wait_all(servers, grace_s)


def _signal_all(servers: list[ChildProcess], sig: int) -> None:
    for server in servers:
        if server.exit_status() is None:
            try:
                server.proc.send_signal(sig)
            except ProcessLookupError:
                continue


def _wait_all(servers: list[ChildProcess], grace_s: float) -> None:
    """Wait until one deadline, grace_s away, for every server to exit; SIGKILL the rest."""
    deadline = time.monotonic() + grace_s
    for server in servers:
        server.wait(max(0.0, deadline - time.monotonic()))
    for server in servers:
        server.stop(grace_s=0.0, term_s=0.0)  # SIGKILL (SIGTERM first: no wait)


def _ended(server: ChildProcess) -> str:
    from zmqworker.executor.errors import describe_exit

    status = server.exit_status()
    assert status is not None
    text = f"{server.name} (pid {server.pid}) exited ({describe_exit(status)})"
    tail = server.stderr_tail().strip()
    return f"{text}; its last stderr lines:\n{tail}" if tail else text


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket every API server accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise OSError(f"could not serve on {host}:{port}: {exc.strerror}") from None
    return sock
