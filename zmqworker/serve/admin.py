"""Admin endpoints for RL loops and operators, off unless the server is started with
--enable-admin-endpoints, and behind the API key when one is set:

    POST /sleep?level=1             give the device memory back (level 2: drop the weights)
    POST /wake_up?tags=weights      take it again ("weights", "kv_cache"; none: both)
    POST /reset_prefix_cache        forget every cached prefix
    POST /update_weights_from_disk  {"model_path": "/ckpt/step-300"} (none: the start-up one)
    GET  /is_sleeping               {"is_sleeping": true}

An admin call waits for this API server's requests running to finish (at most
DRAIN_TIMEOUT_S), then runs on every engine core, between steps; admin calls of one API
server run one at a time. Generation requests do not wait: one that arrives while an
admin call of this API server is under way, or while the engine cores cannot serve
(asleep, or their weights not loaded after sleep level 2), gets 503 at once, with the
reason. With several API servers, the others' requests still running make a sleep fail
(409: the engine core will not drop the KV cache of unfinished requests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query
from pydantic import BaseModel, ConfigDict

from zmqworker.frontend.frontend import Frontend
from zmqworker.serve.errors import APIError

DRAIN_TIMEOUT_S = 300.0
DRAIN_POLL_S = 0.02


class UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str | None = None


class _Gate:
    """One admin call at a time; while one is under way, generation is refused."""

    def __init__(self, llm: Frontend) -> None:
        self.llm = llm
        self.busy: str | None = None
        self._lock = asyncio.Lock()

    async def refusal(self) -> str | None:
        if self.busy is not None:
            return f"{self.busy} is under way"
        return await self.llm.not_ready_async()

    async def run(self, what: str, call: Callable[[], Awaitable[Any]]) -> None:
        async with self._lock:
            self.busy = what
            try:
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                while self.llm.generating:
                    if time.monotonic() > deadline:
                        raise APIError(
                            f"{what}: requests still running after {DRAIN_TIMEOUT_S:g} s",
                            503,
                            "server_error",
                        )
                    await asyncio.sleep(DRAIN_POLL_S)
                await call()
            except ValueError as exc:
                raise APIError.from_value_error(exc) from None
            except RuntimeError as exc:
                raise APIError(str(exc), 409, code="conflict") from None
            finally:
                self.busy = None


def install_admin(app: FastAPI, llm: Frontend) -> None:
    """The admin routes, and the refusal of generation while they need the model."""
    gate = _Gate(llm)
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        await gate.run("sleep", lambda: llm.call_async("sleep", level))
        return {}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict:
        await gate.run("wake_up", lambda: llm.call_async("wake_up", tags))
        return {}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        await gate.run("reset_prefix_cache", lambda: llm.call_async("reset_prefix_cache"))
        return {}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDisk | None = None) -> dict:
        path = body.model_path if body is not None else None
        try:
            await gate.run(
                "update_weights_from_disk", lambda: llm.call_async("reload_weights", path)
            )
        except FileNotFoundError as exc:  # no checkpoint there: the caller's path, not a 500
            raise APIError(str(exc), param="model_path") from None
        return {}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": any(await llm.call_async("is_sleeping"))}

    app.include_router(router)
    app.add_middleware(_RefuseWhileUnavailable, gate=gate)


class _RefuseWhileUnavailable:
    """503 for a generation request (POST /v1/...) that the model cannot serve now. A
    plain ASGI middleware: it leaves streamed responses and disconnects untouched."""

    def __init__(self, app: Any, gate: _Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if scope["path"].startswith("/v1/"):
                reason = await self.gate.refusal()
                if reason is not None:
                    error = APIError(f"unavailable: {reason}", 503, "server_error")
                    await error.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
