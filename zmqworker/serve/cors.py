"""Cross-origin requests from browsers (--allowed-origins and its companions, vLLM's
names), answered by Starlette's CORSMiddleware. Off unless origins are given: without
them the server sends no CORS headers and a browser page on another origin cannot read
its answers."""

from __future__ import annotations

import re

import msgspec
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from zmqworker.serve.request_id import HEADER as REQUEST_ID

_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+")  # scheme://host[:port], no path
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP method or header name


class CorsOptions(msgspec.Struct, frozen=True):
    """What a browser on another origin may do; check() before anything starts."""

    allowed_origins: list[str]
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def check(self) -> None:
        """A ValueError naming the option and the value that no browser would match."""
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"--allowed-origins: {origin!r} is not an origin: expected * or "
                    "scheme://host[:port] with no path (a browser sends "
                    "http://example.com, without a trailing slash)"
                )
        for option, values in (
            ("--allowed-methods", self.allowed_methods),
            ("--allowed-headers", self.allowed_headers),
        ):
            for value in values:
                if value != "*" and not _TOKEN.fullmatch(value):
                    raise ValueError(f"{option}: {value!r} is not * or an HTTP token")

    def install(self, app: Starlette) -> None:
        """The middleware, outermost of those added so far: preflight requests are
        answered before authentication, and errors carry the headers too. A page may
        read the response's request id."""
        app.add_middleware(
            CORSMiddleware,
            allow_origins=self.allowed_origins,
            allow_methods=self.allowed_methods,
            allow_headers=self.allowed_headers,
            allow_credentials=self.allow_credentials,
            expose_headers=[REQUEST_ID],
        )
