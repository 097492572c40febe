"""Each request's id: the client's X-Request-Id header, or one made here. It is echoed in
the response's X-Request-Id header (errors included) and names the response ("cmpl-<id>",
"chatcmpl-<id>"), so a client can find its request in its own logs and in ours. Without
the header, a generation request's vLLM field request_id takes the made one's place
(adopt_request_id), as vLLM's header outranks its body's field. It is not the engine's
request id: clients' ids need not be unique.

Both come from the client: a value that could flood or forge log lines (over MAX_LENGTH
characters, or anything but printable ASCII without spaces) is refused with 400.
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from zmqworker.serve.errors import APIError
from zmqworker.serve.http_middleware import HttpMiddleware

HEADER = "X-Request-Id"
MAX_LENGTH = 128
_SCOPE_KEY = "zmqworker.request_id"
_GIVEN_KEY = "zmqworker.request_id_given"  # by the client's header
_VALID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LENGTH)
_RULE = f"1 to {MAX_LENGTH} printable ASCII characters without spaces"


def request_id(request: Request) -> str:
    """The id of the request being answered (set by RequestId)."""
    return request.scope[_SCOPE_KEY]


def check_request_id(value: str, param: str) -> None:
    """Refuse a request id from a body that the header's rule would refuse."""
    if not _VALID.fullmatch(value.encode("utf-8", "replace")):
        raise APIError(f"{param} must be {_RULE}", param=param)


def adopt_request_id(request: Request, given: str | None) -> None:
    """A body's request_id (checked) becomes the request's id, unless the client's
    X-Request-Id header named it: the response's id and header then carry it."""
    if given is not None and not request.scope[_GIVEN_KEY]:
        request.scope[_SCOPE_KEY] = given


class RequestId(HttpMiddleware):
    """ASGI middleware: the request's id into its scope and its response's headers."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = [v for k, v in scope["headers"] if k == HEADER.lower().encode()]
        if given and (len(given) > 1 or not _VALID.fullmatch(given[0])):
            error = APIError(
                f"the {HEADER} header must be given once, as {_RULE}",
                param=HEADER,
            )
            await error.response()(scope, receive, send)
            return
        value = given[0] if given else uuid.uuid4().hex.encode()
        scope[_SCOPE_KEY] = value.decode("ascii")
        scope[_GIVEN_KEY] = bool(given)

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = scope[_SCOPE_KEY].encode("ascii")  # a body's request_id, adopted
                message["headers"] = [*message.get("headers", []), (HEADER.lower().encode(), value)]
            await send(message)

        await self.app(scope, receive, echo)
