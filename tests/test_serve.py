"""zmqworker serve on the embedded model, called as users call it: the official openai
client against a real server process (completions and chat, streaming and not,
concurrent requests, a client that disconnects, bad requests), and a server whose engine
core or API server is killed. SIGTERM's drain is the last test of test_serve_sampling.py,
on the server the two files share."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest

from tests.test_readme import require_embedded_model
from tests.test_tp_model import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 240


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Server:
    """A `zmqworker serve` process on a free port; stopped with SIGTERM, then killed."""

    def __init__(self, *options: str, engine: bool = True) -> None:
        """engine: the engine cores are this server's (it sizes them), not served apart."""
        require_embedded_model()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        sizes = ["--max-model-len", "512", "--max-num-seqs", "8"] if engine else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zmqworker", "serve", "--port", str(self.port), *sizes,
             *options],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while get_or_none(f"{self.base}/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.output()[-3000:]}")
            time.sleep(0.3)
        self.workers = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", **kw)

    def metrics(self) -> dict[str, float]:
        _, text = get(f"{self.base}/metrics")
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"^zmqworker:(\w+) ([\d.e+-]+)$", text, re.M)
        }

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once no request runs and no KV block is held."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = metrics["num_requests_running"] == 0 and metrics["kv_cache_blocks_used"] == 0
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)

    def output(self) -> str:
        if self.log.closed:
            return self.final_output
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.final_output = self.output()
            self.log.close()
        return self.proc.returncode


def get_or_none(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:
        return None


@pytest.fixture(scope="module")
def server(two_api_servers):
    return two_api_servers  # two processes accepting on the port (conftest.py)


def test_health_models_and_metrics(server):
    assert get(f"{server.base}/health")[0] == 200
    [card] = server.client().models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 512
    metrics = server.metrics()
    assert metrics["kv_cache_blocks"] == 8 * 512 // 16  # sized for the run
    assert metrics["kv_host_blocks"] == 0 == metrics["kv_host_stored_blocks_total"]  # no tier


def test_completion_whole_and_streamed(server):
    client = server.client()
    whole = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    [choice] = whole.choices
    assert choice.text.startswith(" Paris") and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens == 5
    assert whole.usage.total_tokens == 11
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # no prefix cache here
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_with_a_system_message(server):
    client = server.client()
    messages = [
        {"role": "system", "content": "You answer with one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    reply = whole.choices[0].message
    assert reply.role == "assistant" and "Paris" in reply.content
    assert "one word" not in reply.content  # the reply only, not the prompt
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # Without the system message the template's default one applies: another prompt.
    other = client.chat.completions.create(
        model=MODEL, messages=messages[1:], max_tokens=1, temperature=0
    )
    assert other.usage.prompt_tokens != whole.usage.prompt_tokens


def test_logprobs(server):
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value <= 0 and max(top, key=top.get) == token  # greedy: the most likely
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_strings_and_seeds(server):
    client = server.client()
    stopped = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["."]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == " Paris"
    sampled = [
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_penalties_logit_bias_and_vllm_s_extras(server):
    """OpenAI's presence and frequency penalties and logit_bias (token ids as strings),
    vLLM's repetition_penalty, min_tokens and bad_words (extra_body), streamed too."""
    client = server.client()
    base = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}
    london = "4528"  # " London" in SmolLM2's vocabulary
    forced = client.completions.create(**base, max_tokens=3, logit_bias={london: 100})
    assert forced.choices[0].text == " London" * 3
    stream = client.completions.create(**base, max_tokens=3, logit_bias={london: 100}, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == " London" * 3
    banned = client.completions.create(**base, max_tokens=4, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text
    # The stop string ends " Paris." at its second token; min_tokens=3 lets it go on.
    held = client.completions.create(
        **base, max_tokens=12, stop=["."], extra_body={"min_tokens": 3}
    )
    assert held.choices[0].text.startswith(" Paris.") and held.usage.completion_tokens > 3
    repeat = {"model": MODEL, "prompt": "the the the the the the", "temperature": 0}
    plain = client.completions.create(**repeat, max_tokens=8).choices[0].text
    penalised = (
        client.completions.create(
            **repeat,
            max_tokens=8,
            presence_penalty=1.5,
            frequency_penalty=2.0,
            extra_body={"repetition_penalty": 1.3},
        )
        .choices[0]
        .text
    )
    assert penalised != plain
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=4,
        temperature=0,
        frequency_penalty=1.0,
        logit_bias={london: 100},
    )
    assert chat.choices[0].message.content.startswith(" London")


def test_concurrent_clients_share_the_batch(server):
    async def scenario() -> tuple[list[str], float]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused")
        most_running = 0.0

        async def one(i: int) -> str:
            nonlocal most_running
            text = ""
            stream = await client.completions.create(
                model=MODEL, prompt=f"Story {i}:", max_tokens=16, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                text += chunk.choices[0].text
                if len(text) > 10:
                    running = (await asyncio.to_thread(server.metrics))["num_requests_running"]
                    most_running = max(most_running, running)
            return text

        texts = await asyncio.gather(*(one(i) for i in range(4)))
        await client.close()
        return texts, most_running

    texts, most_running = asyncio.run(scenario())
    assert all(texts) and most_running >= 2


def test_a_client_that_disconnects_has_its_request_aborted(server):
    before = server.metrics()["num_requests_aborted_total"]
    stream = server.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    # Long enough for the server to have taken the request in on a loaded machine (one
    # that left before then is never added, so never aborted), far short of its 400 tokens.
    impatient = server.client(timeout=2.0, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    metrics = server.wait_idle()
    assert metrics["num_requests_running"] == 0 and metrics["kv_cache_blocks_used"] == 0
    assert metrics["num_requests_aborted_total"] == before + 2


@pytest.mark.parametrize(
    ("request_args", "status", "param", "message"),
    [
        ({"temperature": -1}, 400, "temperature", "temperature: must be >= 0"),
        ({"extra_body": {"top_k": -5}}, 400, "top_k", "top_k: must be >= -1"),
        ({"max_tokens": 1000}, 400, "max_tokens", "maximum context length is 512"),
        ({"extra_body": {"best": 1}}, 400, "best", "Unrecognized request argument"),
        ({"model": "other"}, 404, "model", "does not exist"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"stop": [""]}, 400, "stop[0]", "stop[0]: must not be empty"),
    ],
)
def test_bad_requests_get_the_openai_error_shape(server, request_args, status, param, message):
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **request_args}
    with pytest.raises(openai.APIStatusError) as caught:
        server.client(max_retries=0).completions.create(**args)
    assert caught.value.status_code == status
    assert caught.value.body["param"] == param and message in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error"


def test_a_bad_chat_request_names_the_field(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client(max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "hi"}]
        )
    assert caught.value.body["param"] == "messages[0].role"


def test_readme_openai_snippet_runs_against_the_server(server):
    from tests.test_readme import python_blocks

    [snippet] = [block for block in python_blocks() if "import openai" in block]
    code = snippet.replace("http://localhost:8000", server.base)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout


def processes(srv: Server, module: str) -> list[psutil.Process]:
    """srv's descendants that run python -m module."""
    return [
        p
        for p in psutil.Process(srv.proc.pid).children(recursive=True)
        if f"-m {module}" in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def doomed():
    """Two servers of two API server processes each, one for each test below that kills
    it: started together, as a start is mostly imports that the machine's cores share."""
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(Server, "--api-server-count", "2") for _ in range(2)]
    servers = [start.result() for start in starts if start.exception() is None]
    try:
        if len(servers) < len(starts):
            raise next(start.exception() for start in starts if start.exception())
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def test_a_killed_engine_core_fails_the_stream_naming_it_and_stops_the_server(doomed):
    srv = doomed[0]
    everything = psutil.Process(srv.proc.pid).children(recursive=True)
    try:
        [core] = processes(srv, "zmqworker.engine")
        assert core.cmdline()[-1] == str(srv.proc.pid)  # its spawner's (follow_spawner)
        stream = srv.client(max_retries=0).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        core.kill()
        with pytest.raises(openai.APIError, match=r"engine core 0 \(pid \d+\) exited"):
            for _ in chunks:
                pass
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    assert "engine core 0" in srv.output().splitlines()[-1]
    assert not any(p.is_running() and p.status() != "zombie" for p in everything)


def test_a_killed_api_server_stops_the_whole_server(doomed):
    srv = doomed[1]
    everything = psutil.Process(srv.proc.pid).children(recursive=True)
    try:
        victim = processes(srv, "zmqworker.serve.api_server")[1]
        assert victim.cmdline()[-1] == str(srv.proc.pid)
        victim.kill()
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    assert re.search(r"api server \d \(pid \d+\) exited \(killed by SIGKILL", srv.output())
    assert not any(p.is_running() and p.status() != "zombie" for p in everything)
