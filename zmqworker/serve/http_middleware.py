"""What the server's ASGI middlewares share: HTTP requests go to their handle(), other
scopes (lifespan) pass by; a request's header by name; and a send that notes whether the
response has started, after which an error can no longer be answered as a response of
its own."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMiddleware(ABC):
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request, through self.app."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of the request's header name (lower case, as ASGI gives them)."""
    return next((value for key, value in scope["headers"] if key == name), None)


class StartWatch:
    """send, noting whether the response has started."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)
