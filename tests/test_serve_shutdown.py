"""SIGTERM's drain with requests that outlast it (`--shutdown-timeout`): what still runs
at the deadline is answered, a whole request with a 503 in OpenAI's error shape, a
stream with an error event and its [DONE], before the server stops; nothing is cut."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

from tests.test_serve import MODEL, Server


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
