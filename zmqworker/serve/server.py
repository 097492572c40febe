"""Run the server: the LLM first (its start-up, logged phase by phase), then uvicorn on
uvloop. SIGINT or SIGTERM: uvicorn stops taking connections and lets the requests in
flight finish (at most shutdown_timeout_s, then cancels them: their requests are aborted),
and then the workers stop."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

from zmqworker.frontend.llm import LLM
from zmqworker.serve.app import build_app

logger = logging.getLogger(__name__)


def serve(
    engine_options: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "warning",
) -> None:
    llm = LLM(**engine_options)
    try:
        name = served_model_name or llm.model_folder.path.name
        config = uvicorn.Config(
            build_app(llm, name, api_key),
            host=host,
            port=port,
            loop="uvloop",
            timeout_graceful_shutdown=shutdown_timeout_s,
            log_level=log_level,
            access_log=log_level in ("debug", "info"),
        )
        server = _Server(config)
        logger.info("serving %s on http://%s:%d/v1", name, host, port)
        server.run()
        if not server.started:
            raise OSError(f"could not serve on {host}:{port} (see the error above)")
    finally:
        logger.info("stopping the workers")
        llm.shutdown()


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal ends run() instead of the process: uvicorn
    raises the signal again once it has shut down, which would kill the process before
    the workers are stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
