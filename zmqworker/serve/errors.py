"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, and the
middleware that answers a request's unexpected failure in it (ServerErrors)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from zmqworker.serve.http_middleware import HttpMiddleware, StartWatch

logger = logging.getLogger(__name__)

# msgspec names the field of a bad value as "- at `$.temperature`".
_MSGSPEC_PATH = re.compile(r"at `\$\.(\w+)")


class APIError(Exception):
    """An error a request gets back, with its HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = _printable(message)
        self.status = status
        self.type = type
        self.param = None if param is None else _printable(param)
        self.code = code

    @classmethod
    def from_value_error(cls, exc: ValueError, param: str | None = None) -> APIError:
        """A bad value the engine refused (a prompt too long, a sampling value out of
        range): 400, naming the field the message names, else param."""
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        match = _MSGSPEC_PATH.search(message)
        return cls(message, param=match.group(1) if match else param)

    @classmethod
    def from_validation(cls, errors: Sequence[Any]) -> APIError:
        """FastAPI's check of a route's query or pydantic body (the admin routes'), as the
        400 vLLM answers in this shape, not FastAPI's 422 {"detail": [...]}."""
        error = errors[0]
        if error["type"] == "json_invalid":
            reason = error.get("ctx", {}).get("error", error["msg"])
            return cls(f"the request body is not valid JSON: {reason}")
        param = ".".join(str(part) for part in error["loc"][1:]) or None  # after "query"/"body"
        return cls(f"{param or 'the request body'}: {error['msg']}", param=param)

    @classmethod
    def of(cls, exc: Exception) -> APIError:
        """What a stream tells its client before it ends: exc as it is (an APIError), a
        refused value's 400, or the engine's failure (500)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ValueError):
            return cls.from_value_error(exc)
        return cls(f"{type(exc).__name__}: {exc}", 500, "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _printable(text: str) -> str:
    """text as UTF-8 can carry it: an error may quote what the request held, lone
    surrogates included, and a response that cannot be encoded would be a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ServerErrors(HttpMiddleware):
    """ASGI middleware, inside RequestId and CORS: an unexpected exception becomes a 500 in
    the OpenAI shape that carries their headers. Starlette's handler for Exception runs
    outside every middleware, so its 500s had no X-Request-Id for the client to quote."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        watched = StartWatch(send)
        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if watched.started:  # too late for a 500: the HTTP server logs it, cuts the response
                raise
            logger.exception("request failed")
            error = APIError(f"{type(exc).__name__}: {exc}", 500, "server_error")
            await error.response()(scope, receive, send)
