"""POST bodies are JSON: an ASGI middleware that answers 415 to a POST declaring another
Content-Type. A browser page on any origin may send a form or text/plain POST without
asking first (no CORS preflight), and the body would be read as JSON all the same; a
declared JSON type makes the browser ask. A POST without a Content-Type is read as JSON,
as FastAPI does."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from zmqworker.serve.errors import APIError
from zmqworker.serve.http_middleware import HttpMiddleware, header


class JsonContent(HttpMiddleware):
    """ASGI middleware: 415 for a POST whose Content-Type is not JSON."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            declared = header(scope, b"content-type")
            media = _media_type(declared)
            if media is not None and media != "application/json" and not media.endswith("+json"):
                error = APIError(
                    f"Content-Type {declared.decode('latin-1')!r} is not JSON: send the body "
                    "as application/json (curl: -H 'Content-Type: application/json')",
                    415,
                    param="Content-Type",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _media_type(declared: bytes | None) -> str | None:
    """The type/subtype of a Content-Type header, lower case, without its parameters."""
    if declared is None:
        return None
    return declared.decode("latin-1").split(";", 1)[0].strip().lower()
