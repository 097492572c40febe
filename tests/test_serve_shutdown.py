"""SIGTERM's drain with requests that outlast it (`--shutdown-timeout`): what still runs
at the deadline is answered, a whole request with a 503 in OpenAI's error shape, a
stream with an error event and its [DONE], before the server stops; nothing is cut. A
request whose handler was still preparing it then (its body still coming, its prompt
being tokenized) gets the same 503 when it would start."""

from __future__ import annotations

import http.client
import json
import signal
import socket
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
