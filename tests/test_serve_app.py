"""The API server's answers outside generation, called over ASGI on build_app's app with a
stand-in frontend (no model, no sockets: fast): every error in the OpenAI shape with the
request's id (FastAPI's own checks, unexpected failures, a client gone mid-body), the
metrics' series before any request, and `zmqworker serve`'s options refused by name
before anything starts."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest

from zmqworker.cli import build_parser
from zmqworker.cli import serve as serve_cli
from zmqworker.frontend.frontend import Frontend
from zmqworker.serve.app import build_app
from zmqworker.serve.cors import CorsOptions
from zmqworker.serve.metrics import ServerMetrics

KEY = "sekret"
APP = "http://app.example"


class StandIn:
    """What build_app and the admin routes ask of a Frontend, without engine cores."""

    generating = 0

    def __init__(self, failure: Exception | None = None, not_ready: str | None = None) -> None:
        self.failure = failure
        self.not_ready = not_ready

    def observe_outputs(self, observer: Any) -> None:
        pass

    async def call_async(self, method: str, *args: Any) -> None:
        if self.failure is not None:
            raise self.failure

    async def not_ready_async(self) -> str | None:
        return self.not_ready


def make_app(failure: Exception | None = None, not_ready: str | None = None) -> FastAPI:
    app = build_app(
        cast(Frontend, StandIn(failure, not_ready)), "m", api_key=KEY, enable_admin_endpoints=True,
        cors=CorsOptions([APP]),
    )  # fmt: skip

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    return app


def call(
    app: FastAPI,
    method: str,
    url: str,
    body: bytes = b"",
    whole: bool = True,
    **header: str | None,
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, decoded JSON or None); whole=False: the client leaves mid-body;
    header: headers to change (content_type=...) or leave out (None)."""
    parts = urlsplit(url)
    declared = len(body) if whole else len(body) + 9
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": "r-1", "origin": APP,
               "content-type": "application/json", "content-length": str(declared)}  # fmt: skip
    for name, value in header.items():
        headers[name.replace("_", "-")] = value  # type: ignore[assignment]
    headers = {k: v for k, v in headers.items() if v is not None}
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": parts.path, "raw_path": parts.path.encode(),
        "query_string": parts.query.encode(), "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    incoming = [{"type": "http.request", "body": body, "more_body": not whole}]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    got = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    is_json = got.get("content-type") == "application/json"
    return sent[0]["status"], got, json.loads(payload) if is_json else None


def test_an_unexpected_failure_is_a_500_with_the_request_s_id_and_cors(caplog):
    status, headers, body = call(make_app(), "GET", "/boom")
    assert status == 500 and body["error"]["message"] == "RuntimeError: kaput"
    assert headers["x-request-id"] == "r-1" and headers["access-control-allow-origin"] == APP
    assert "request failed" in caplog.text


@pytest.mark.parametrize(
    ("url", "body", "param", "message"),
    [
        ("/sleep?level=abc", b"", "level", "level: Input should be a valid integer"),
        ("/update_weights_from_disk", b"{bad", None, "the request body is not valid JSON"),
        ("/update_weights_from_disk", b'{"x": 1}', "x", "x: Extra inputs are not permitted"),
    ],
)
def test_fastapi_s_checks_are_400s_in_the_openai_shape(url, body, param, message):
    status, headers, answer = call(make_app(), "POST", url, body)
    assert status == 400 and headers["x-request-id"] == "r-1"
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(message)


@pytest.mark.parametrize(
    "authorization", [None, f"Bearer {KEY}x", f"bearer {KEY}", KEY, "Bearer \u00e9"]
)
def test_a_request_without_the_key_learns_nothing_else(authorization):
    """401 before the server's state (503 while asleep), the body's size or its type."""
    asleep = make_app(not_ready="the engine cores are asleep")
    for url, body, header in [
        ("/v1/completions", b'{"model": "m", "prompt": "hi"}', {}),
        ("/v1/models", b"", {}),
        ("/sleep", b"", {}),
        ("/v1/completions", b"x", {"content_type": "text/plain"}),
        ("/nowhere", b"", {}),
    ]:
        method = "GET" if url == "/v1/models" else "POST"
        status, headers, answer = call(
            asleep, method, url, body, authorization=authorization, **header
        )
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), url
        assert headers["x-request-id"] == "r-1" and headers["access-control-allow-origin"] == APP
    assert call(asleep, "POST", "/v1/completions", b"{}")[0] == 503  # with the key
    status, _, answer = call(asleep, "GET", "/version", authorization=None)  # open
    assert status == 200 and "version" in answer


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""],
)
def test_a_post_declaring_a_body_other_than_json_is_a_415(content_type):
    """A browser page may send these to any origin without asking (no CORS preflight)."""
    body = b'{"model": "m", "prompt": "hi"}'
    status, _, answer = call(make_app(), "POST", "/v1/completions", body, content_type=content_type)
    assert status == 415 and answer["error"]["param"] == "Content-Type"
    assert "application/json" in answer["error"]["message"]


@pytest.mark.parametrize(
    "content_type", [None, "application/json; charset=utf-8", "Application/JSON", "x/y+json"]
)
def test_a_post_declaring_json_or_nothing_is_read(content_type):
    body = b'{"model": "other", "prompt": "hi"}'
    status, _, answer = call(make_app(), "POST", "/v1/completions", body, content_type=content_type)
    assert status == 404 and answer["error"]["code"] == "model_not_found"  # read, then checked


def test_a_checkpoint_path_with_no_checkpoint_is_the_caller_s_400():
    missing = FileNotFoundError("checkpoint folder /nowhere does not exist")
    status, _, answer = call(
        make_app(missing), "POST", "/update_weights_from_disk", b'{"model_path": "/nowhere"}'
    )
    assert status == 400 and answer["error"]["param"] == "model_path"
    assert answer["error"]["message"] == "checkpoint folder /nowhere does not exist"


def test_a_client_gone_before_its_whole_body_is_no_server_error(caplog):
    with caplog.at_level(logging.ERROR):
        status, _, _ = call(make_app(), "POST", "/tokenize", b'{"model": "m"', whole=False)
    assert status == 499 and not caplog.records


def test_every_request_series_is_scraped_at_zero_before_any_request(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    text = generate_latest(ServerMetrics("m").registry).decode()
    for series in (
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 0.0',
        'vllm:request_success_total{finished_reason="length",model_name="m"} 0.0',
        'vllm:prompt_tokens_total{model_name="m"} 0.0',
        'vllm:generation_tokens_total{model_name="m"} 0.0',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 0.0',
    ):
        assert series in text.splitlines()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-server-count", "0"], "--api-server-count must be >= 1, got 0"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be finite and >= 0, got -1.0"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be finite and >= 0, got nan"),
        (["--shutdown-timeout", "inf"], "--shutdown-timeout must be finite and >= 0, got inf"),
        (["--api-key", ""], "--api-key is empty: give a key"),  # "$KEY" of an unset KEY
        (["--api-key", "  "], "--api-key is empty"),
    ],
)
def test_serve_options_are_checked_before_anything_starts(argv, message):
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--model", "/nowhere", *argv])
    with pytest.raises(ValueError, match=re.escape(message)):
        serve_cli.run(args)
