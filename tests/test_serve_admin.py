"""The server's admin endpoints over a tiny model, served by uvicorn in this process:
sleep and wake_up with generation refused (503) while the model cannot serve, weights
reloaded from disk, the API key, and the endpoints absent unless enabled."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn

from tests.test_tp_model import free_port
from tests.test_weight_updates import checkpoint
from tests.tiny import cached_tiny_checkpoint
from zmqworker.frontend.llm import LLM
from zmqworker.serve.app import build_app

KEY = "sekret"
COMPLETION = {"model": "tiny", "prompt": "Hello world", "max_tokens": 6, "temperature": 0}


class Served:
    """build_app's app on a free port, uvicorn in a thread."""

    def __init__(self, llm: LLM, admin: bool) -> None:
        app = build_app(llm, "tiny", api_key=KEY, enable_admin_endpoints=admin)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def call(self, method: str, path: str, body: dict | None = None, key: str = KEY):
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def llm():
    with LLM(checkpoint(False), block_size=4, max_model_len=64, kv_cache_bytes=1 << 20) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(llm):
    served = Served(llm, admin=True)
    yield served
    served.stop()


def completion(served: Served) -> tuple[int, str]:
    status, body = served.call("POST", "/v1/completions", COMPLETION)
    return status, body["choices"][0]["text"] if status == 200 else body["error"]["message"]


def test_sleep_wake_and_reload_between_generations(served):
    status, text = completion(served)
    assert status == 200
    assert served.call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert served.call("POST", "/sleep?level=1")[0] == 200
    assert served.call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert completion(served) == (503, "unavailable: asleep (kv_cache, weights released): "
                                       "call wake_up()")  # fmt: skip
    assert served.call("POST", "/wake_up?tags=weights")[0] == 200
    assert served.call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert served.call("POST", "/wake_up")[0] == 200
    assert completion(served) == (200, text)
    # Level 2: the weights come back from disk.
    assert served.call("POST", "/sleep?level=2")[0] == 200
    assert served.call("POST", "/wake_up")[0] == 200
    status, message = completion(served)
    assert status == 503 and "released by sleep(level=2)" in message
    assert served.call("POST", "/update_weights_from_disk", {})[0] == 200
    assert completion(served) == (200, text)
    assert served.call("POST", "/reset_prefix_cache")[0] == 200
    assert completion(served) == (200, text)


def test_bad_admin_calls_are_refused(served):
    other = cached_tiny_checkpoint(family="llama", num_layers=2, vocab_size=320)
    status, body = served.call("POST", "/update_weights_from_disk", {"model_path": other})
    assert status == 400 and "num_hidden_layers: 4 vs 2" in body["error"]["message"]
    status, body = served.call("POST", "/sleep?level=3")
    assert status == 400 and "sleep level must be 1 or 2" in body["error"]["message"]
    assert served.call("POST", "/sleep", key="wrong")[0] == 401
    assert served.call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert completion(served)[0] == 200


def test_admin_endpoints_are_off_unless_enabled(llm):
    served = Served(llm, admin=False)
    try:
        assert served.call("POST", "/sleep")[0] == 404
        assert served.call("GET", "/is_sleeping")[0] == 404
    finally:
        served.stop()
