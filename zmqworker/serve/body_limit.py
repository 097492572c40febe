"""The bound on request bodies (--max-request-bytes): an ASGI middleware that answers 413
as soon as a body is known to be larger, by its Content-Length before any of it is read,
or by counting a chunked body's bytes as they come. The body is never held whole: what
the client still sends is dropped by the HTTP server as it arrives."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zmqworker.serve.errors import APIError
from zmqworker.serve.http_middleware import HttpMiddleware, StartWatch, header

# The default bound. A prompt filling a 128k-token context takes about 1 MB of JSON, as
# text (about 4 bytes a token; more with \u escapes) or as token ids (at most 7 bytes
# each): 4 MiB carries one with room. Decoding the largest body holds the GIL, and so
# the event loop, for some tens of milliseconds even in a thread: the bound bounds that.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class _BodyTooLarge(Exception):
    """A body grew past the bound while the application read it."""


class BodyLimit(HttpMiddleware):
    """ASGI middleware: 413 for a body over max_bytes, in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"of {declared} bytes ")
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        watched = StartWatch(send)
        try:
            await self.app(scope, counted, watched)
        except _BodyTooLarge:
            if watched.started:
                raise
            await self._refuse(scope, receive, send, "")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        error = APIError(
            f"the request body {size}is larger than this server takes: at most "
            f"{self.max_bytes} bytes (--max-request-bytes)",
            413,
        )
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    value = header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # the HTTP server refuses a malformed one
