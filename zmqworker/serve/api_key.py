"""The API key (--api-key): an ASGI middleware that answers 401 to a request without it
before anything else looks at the request, so that a caller without the key learns
nothing of the server's state (asleep, busy) or of its limits. Probes and scrapes stay
open: /health, /version, /metrics and the API's description."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from zmqworker.serve.errors import APIError
from zmqworker.serve.http_middleware import HttpMiddleware, header

OPEN_PATHS = frozenset(
    {"/health", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)


class ApiKey(HttpMiddleware):
    """ASGI middleware: 401 unless the request carries "Authorization: Bearer <key>"."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        super().__init__(app)
        self.expected = f"Bearer {key}".encode()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            given = header(scope, b"authorization") or b""
            if not secrets.compare_digest(given, self.expected):
                error = APIError("Incorrect API key provided", 401, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
