"""SIGTERM's drain with requests that outlast it (`--shutdown-timeout`): what still runs
at the deadline is answered, a whole request with a 503 in OpenAI's error shape, a
stream with an error event and its [DONE], before the server stops; nothing is cut. A
request whose handler was still preparing it then (its body still coming, its prompt
being tokenized) gets the same 503 when it would start."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import threading
import time

from tests.test_serve import MODEL, Server
from zmqworker.engine.core_server import CLIENT_SILENT_S


def post(server: Server, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_requests_past_the_drain_are_answered_with_an_error():
    server = Server("--shutdown-timeout", "1")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    answers: dict[str, tuple[int, str]] = {}
    streamed = {**body, "stream": True}
    threads = [
        threading.Thread(target=lambda: answers.update(whole=post(server, body))),
        threading.Thread(target=lambda: answers.update(stream=post(server, streamed))),
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while server.metrics()["num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.stop() == 0, server.output()[-2000:]
    finally:
        server.stop()
    status, text = answers["whole"]
    assert status == 503, text
    error = json.loads(text)["error"]
    assert error["type"] == "server_error"
    assert error["message"].startswith("the server is shutting down: the request ran past its 1 s")
    status, text = answers["stream"]
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"].startswith("the server is shutting down")
    assert "Cancel" not in server.output()  # uvicorn cancelled nothing


def test_a_request_still_being_prepared_at_the_deadline_gets_the_503():
    """Its body comes whole only after the deadline: its handler then reads, tokenizes
    and adds it, past Frontend.fail_all, and that add is refused with fail_all's error
    (it used to run until uvicorn cancelled its handler, which answers a bare 500)."""
    server = Server("--shutdown-timeout", "1")
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
                       "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(head + body[:-1])
            time.sleep(0.5)  # the handler waits for the body's last byte
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while "draining the requests" not in server.output():  # the API server's SIGTERM
                assert time.monotonic() < deadline, server.output()[-2000:]
                time.sleep(0.05)
            time.sleep(2.0)  # past the drain's 1 s deadline, within uvicorn's 3 s
            sock.sendall(body[-1:])
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert server.stop() == 0, server.output()[-2000:]
    finally:
        server.stop()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 503 "), answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"].startswith("the server is shutting down: the request ran past its 1 s")
    assert "Cancel" not in server.output()


def test_a_dead_replica_stops_the_server_answering_the_others_streams():
    """Data-parallel: an engine core killed, the streams of the replica that lives on end
    with an error event naming the dead one and [DONE] (its API server is told at once,
    before the server stops), not a cut stream."""
    from tests.test_serve import processes

    server = Server("--data-parallel-size", "2", "--api-server-count", "1")
    body = {"model": MODEL, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    answers: dict[int, tuple[int, str]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: answers.update({i: post(server, {**body, "prompt": f"{i} and"})})
        )
        for i in range(2)
    ]  # one on each replica (the least loaded gets the next)
    try:
        cores = processes(server, "zmqworker.engine")
        assert len(cores) == 2
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while server.metrics().get("num_requests_running", 0) < 2:
            assert time.monotonic() < deadline, server.output()[-2000:]
            time.sleep(0.05)
        cores[1].kill()
        for thread in threads:
            thread.join(60)
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    named = re.compile(rf"engine core \d \(pid {cores[1].pid}\) (exited|died)")
    assert len(answers) == 2, answers  # neither cut
    errors = []
    for status, text in answers.values():
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert status == 200 and events[-1] == "[DONE]", text[-500:]
        errors.append(json.loads(events[-2])["error"]["message"])
        assert named.search(errors[-1]), errors[-1]
    # The survivor's stream: its API server was told, by the main process.
    assert any(error.startswith("the server stops: ") for error in errors), errors
    assert "Cancel" not in server.output()


def test_an_api_server_its_engine_core_dropped_stops_the_server():
    """Paused past the engine core's bound for a silent client, an API server is dropped
    by it, which lives on: the API server must not answer every request after with an
    error, unnoticed. It exits, and the main process stops the whole server naming it."""
    from tests.test_serve import processes

    server = Server("--api-server-count", "1")
    try:
        [api] = processes(server, "zmqworker.serve.api_server")
        assert post(server, {"model": MODEL, "prompt": "Hi", "max_tokens": 1})[0] == 200
        api.send_signal(signal.SIGSTOP)
        time.sleep(CLIENT_SILENT_S + 2)
        api.send_signal(signal.SIGCONT)
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    output = server.output()
    assert f"api server 0 (pid {api.pid}) exited (exit status 1)" in output, output[-2000:]
    assert "the server stops: engine core 0" in output and "connection dropped" in output


def test_metrics_answer_with_an_engine_core_dead():
    """/metrics reads the live engine cores only (a dead one's stats are gone), and keeps
    this API server's own series; zmqworker:engine_cores_up counts the live ones."""
    from types import SimpleNamespace
    from typing import cast

    from tests.test_serve_app import KEY, StandIn
    from zmqworker.frontend.frontend import Frontend
    from zmqworker.frontend.outputs import EngineCoreStats
    from zmqworker.serve.app import build_app

    asked: list[list[int]] = []

    async def call_async(method: str, engines: list[int]) -> list[EngineCoreStats]:
        asked.append(engines)
        return [EngineCoreStats(3, 1, 100, 60, 0, 0) for _ in engines]

    engines = [SimpleNamespace(index=0, dead=None), SimpleNamespace(index=1, dead=OSError())]
    frontend = StandIn()
    frontend.client = SimpleNamespace(engines=engines, loop=object(), call_async=call_async)
    app = build_app(cast(Frontend, frontend), "m", api_key=KEY)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/metrics", "raw_path": b"/metrics",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"authorization", f"Bearer {KEY}".encode())]}  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert sent[0]["status"] == 200, text
    assert asked == [[0]]
    assert "zmqworker:engine_cores_up 1.0" in text
    assert "zmqworker:num_requests_running 3.0" in text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="m"}' in text
