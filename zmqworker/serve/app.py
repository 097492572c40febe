"""The FastAPI application of one API server process, over its client of the engine
cores (a Frontend): the OpenAI routes, /tokenize and /detokenize, /health, /metrics,
errors; each request's id (request_id.py), the API key (api_key.py), JSON bodies only
(json_content.py) and, when asked for, CORS (cors.py).

Handlers run on the server's event loop, which also watches the engine cores' sockets:
concurrent requests, of this API server and the others, share the engine cores' steps.
/metrics and /health cover every engine core, whichever API server answers. What a
request costs in proportion to its size stays off the loop: its body is bounded
(body_limit.py), decoded and tokenized in the text pool, so /health and the streams in
flight keep answering.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from zmqworker import __version__
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import EngineStats
from zmqworker.serve.admin import install_admin
from zmqworker.serve.api_key import ApiKey
from zmqworker.serve.body import decode_body
from zmqworker.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from zmqworker.serve.chat import create_chat_completion
from zmqworker.serve.completions import create_completion
from zmqworker.serve.cors import CorsOptions
from zmqworker.serve.errors import APIError, ServerErrors
from zmqworker.serve.generation import ClientDisconnected, now
from zmqworker.serve.json_content import JsonContent
from zmqworker.serve.metrics import ServerMetrics
from zmqworker.serve.protocol import ChatCompletionRequest, CompletionRequest
from zmqworker.serve.request_id import RequestId, adopt_request_id
from zmqworker.serve.text_pool import TextPool
from zmqworker.serve.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from zmqworker.serve.tools import ToolOptions

HEALTH_TIMEOUT_S = 10.0


def build_app(
    llm: Frontend,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    enable_admin_endpoints: bool = False,
    cors: CorsOptions | None = None,
    tools: ToolOptions | None = None,
) -> FastAPI:
    text = TextPool()
    tool_options = tools or ToolOptions()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            text.shutdown()

    app = FastAPI(title="zmqworker", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    server_metrics = ServerMetrics(model_name)
    llm.observe_outputs(server_metrics.observe)

    if enable_admin_endpoints:
        install_admin(app, llm)
    app.add_middleware(JsonContent)
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)  # outside the others: 401 before anything
    app.add_middleware(ServerErrors)
    app.add_middleware(RequestId)  # outside the others: their errors carry the id too
    if cors is not None:
        cors.install(app)

    def check_model(name: str | None) -> None:
        """The served model, or left out (vLLM's: the served model)."""
        if name is not None and name != model_name:
            raise APIError(
                f"The model `{name}` does not exist (this server serves `{model_name}`).",
                404,
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        try:
            await llm.check_health_async(HEALTH_TIMEOUT_S)
        except Exception as exc:
            return APIError(f"unhealthy: {exc}", 503, "server_error").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    up = _EnginesUp()
    server_metrics.registry.register(up)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The live engine cores' stats (a dead one, while the server stops, is left out:
        its stats are gone) and this API server's own counters."""
        engines = llm.client.engines
        live = [e.index for e in engines if e.dead is None]
        up.count = len(live)
        stats = None
        if len(live) == len(engines):
            stats = await llm.stats_async()
        elif live and llm.client.loop is not None:  # attached by an earlier call
            stats = EngineStats.total(await llm.client.call_async("stats", engines=live))
        server_metrics.engines.stats = stats
        return Response(generate_latest(server_metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "zmqworker",
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await text.run(decode_body, await request.body(), CompletionRequest)
        adopt_request_id(request, body.request_id)
        check_model(body.model)
        return await create_completion(llm, model_name, body, request, text)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await text.run(decode_body, await request.body(), ChatCompletionRequest)
        adopt_request_id(request, body.request_id)
        check_model(body.model)
        return await create_chat_completion(llm, model_name, body, request, text, tool_options)

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> dict:
        body = await text.run(decode_body, await request.body(), TokenizeRequest)
        check_model(body.model)
        return await text.run(tokenize, llm, body)

    @app.post("/detokenize")
    async def detokenize_tokens(request: Request) -> dict:
        body = await text.run(decode_body, await request.body(), DetokenizeRequest)
        check_model(body.model)
        return await text.run(detokenize, llm, body)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    # A client gone while generating, or before its whole body came (Starlette's).
    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError.from_validation(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).response()

    started = now()
    return app


class _EnginesUp:
    """zmqworker:engine_cores_up: the engine cores alive, as the last scrape saw them."""

    def __init__(self) -> None:
        self.count: int | None = None

    def collect(self) -> Iterator[Metric]:
        if self.count is not None:
            yield GaugeMetricFamily("zmqworker:engine_cores_up", "engine cores alive", self.count)
