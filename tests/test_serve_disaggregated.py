"""zmqworker serve --disaggregate on the embedded model, called as users call it (the
official openai client): greedy completions through a prefill and a decode instance
equal those of the colocated server test_serve.py shares (or one of this file's own),
whole and streamed, with the logprobs of every token (the first one's from the prefill
side), and prompt logprobs (the prefill's); a prompt of few tokens computed on the decode
side alone; no KV block stays held on
either side; and a killed prefill instance fails the requests it held, naming it, and
stops the whole server. One disaggregated server for the file: the last test kills it."""

from __future__ import annotations

import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest

from tests.test_serve import MODEL, Server, processes
from tests.test_tp_model import free_port

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "List three colours: red,",
    # Longer than the prefill's token budget per step: its prefill is chunked.
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island "
    "far from the coast. Every night he climbed the stairs, lit the lamp and watched "
    "the ships pass in the dark. One winter night a storm came, and",
]
MAX_TOKENS = 12
LOCAL = 2  # --max-local-prefill-tokens: shorter than every prompt above


@pytest.fixture(scope="module")
def disaggregated():
    kv_port = free_port()
    srv = Server(
        "--disaggregate", "--api-server-count", "1", "--max-num-batched-tokens", "32",
        "--kv-port", str(kv_port), "--kv-transfer-timeout", "20",
        "--max-local-prefill-tokens", str(LOCAL),
    )  # fmt: skip
    srv.kv_port = kv_port
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def colocated(request):
    """The server test_serve.py shares while it runs (this file runs before the one that
    stops it), or one of this file's own."""
    shared = request.getfixturevalue("two_api_servers")
    if shared.proc.poll() is None:
        yield shared
        return
    srv = Server("--api-server-count", "1")
    yield srv
    srv.stop()


def complete(srv: Server, prompt: str, stream: bool) -> tuple[str, str]:
    """The greedy completion's text and finish reason."""
    client = srv.client(max_retries=0)
    args = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        [choice] = client.completions.create(**args).choices
        return choice.text, choice.finish_reason
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def complete_all(srv: Server, stream: bool) -> list[tuple[str, str]]:
    """Every prompt at once (a batch in the engine cores)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: complete(srv, p, stream), PROMPTS))


def test_greedy_completions_equal_colocated_ones(disaggregated, colocated):
    expected = complete_all(colocated, stream=False)
    assert expected[0][0].startswith(" Paris")
    assert complete_all(disaggregated, stream=False) == expected
    assert complete_all(disaggregated, stream=True) == expected
    # Both sides hold no block: the prefill's staged KV went once the decode side took it.
    metrics = disaggregated.wait_idle()
    assert metrics["kv_cache_blocks_used"] == 0 and metrics["kv_cache_blocks"] == 2 * 8 * 512 // 16
    # Without prefix caching the decode side has nothing to reuse: every block is pulled.
    assert metrics["kv_remote_pulled_blocks_total"] >= 2 * len(PROMPTS)
    assert metrics["kv_remote_hit_blocks_total"] == 0


def test_a_prompt_of_few_tokens_is_computed_on_the_decode_side(disaggregated, colocated):
    """--max-local-prefill-tokens: a prompt of at most that many tokens goes to the decode
    instance alone (nothing is pulled), and its completion is a colocated server's."""
    args = dict(model=MODEL, prompt=[504, 3575], max_tokens=MAX_TOKENS, temperature=0)
    [expected] = colocated.client(max_retries=0).completions.create(**args).choices
    pulled = disaggregated.wait_idle()["kv_remote_pulled_blocks_total"]
    [got] = disaggregated.client(max_retries=0).completions.create(**args).choices
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
    metrics = disaggregated.wait_idle()
    assert metrics["kv_remote_pulled_blocks_total"] == pulled
    assert metrics["kv_cache_blocks_used"] == 0


def test_a_first_token_that_ends_the_request_stays_on_the_prefill_side(disaggregated):
    client = disaggregated.client(max_retries=0)
    [one] = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0
    ).choices
    assert one.text == " Paris" and one.finish_reason == "length"
    assert disaggregated.wait_idle()["kv_cache_blocks_used"] == 0


def test_prompt_logprobs_come_from_the_prefill_side(disaggregated, colocated):
    """The decode side never computes the prompt: asked for, the prompt logprobs are the
    prefill's, equal to a colocated server's, and the completion is the one without."""
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    asked = {"prompt_logprobs": 2}
    [expected] = (
        colocated.client(max_retries=0).completions.create(**args, extra_body=asked).choices
    )
    client = disaggregated.client(max_retries=0)
    [got] = client.completions.create(**args, extra_body=asked).choices
    [plain] = client.completions.create(**args).choices
    assert got.text == plain.text == expected.text
    assert plain.model_extra.get("prompt_logprobs") is None
    mine, theirs = got.model_extra["prompt_logprobs"], expected.model_extra["prompt_logprobs"]
    assert len(mine) == len(theirs) > 1 and mine[0] is None and theirs[0] is None
    for position, reference in zip(mine[1:], theirs[1:], strict=True):
        assert {t: e["rank"] for t, e in position.items()} == {
            t: e["rank"] for t, e in reference.items()
        }
        logprobs = [e["logprob"] for e in reference.values()]
        assert [e["logprob"] for e in position.values()] == pytest.approx(logprobs, abs=1e-4)
    assert disaggregated.wait_idle()["kv_cache_blocks_used"] == 0


def test_logprobs_cover_every_token_the_first_one_the_prefill_s(disaggregated, colocated):
    """The first token and its logprobs come from the prefill side, the rest from the
    decode side: streamed or whole, every token has its logprobs, equal to a colocated
    server's."""
    args = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2)
    [expected] = colocated.client(max_retries=0).completions.create(**args).choices
    client = disaggregated.client(max_retries=0)
    [whole] = client.completions.create(**args).choices
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    streamed = [t for c in chunks if c.logprobs is not None for t in c.logprobs.tokens]
    assert whole.text == expected.text and streamed == expected.logprobs.tokens
    got, want = whole.logprobs, expected.logprobs
    assert got.tokens == want.tokens and len(got.tokens) == 5
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
    for mine, theirs in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4)
    assert disaggregated.wait_idle()["kv_cache_blocks_used"] == 0


def test_a_killed_prefill_instance_fails_its_requests_naming_it(disaggregated):
    srv = disaggregated
    everything = psutil.Process(srv.proc.pid).children(recursive=True)
    [prefill] = [p for p in processes(srv, "zmqworker.engine") if _serves_kv(p, srv.kv_port)]
    prefill.send_signal(signal.SIGSTOP)  # the requests below wait on it, then it dies
    errors: list[str] = []

    def send(prompt: str) -> None:
        try:
            complete(srv, prompt, stream=False)
        except openai.APIError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=send, args=(p,)) for p in PROMPTS[:3]]
    for thread in threads:
        thread.start()
    threads[0].join(3.0)  # time to reach the prefill instance, on a loaded machine too
    prefill.kill()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 3
    assert all(re.search(r"the prefill instance: engine core 0 \(pid \d+\)", e) for e in errors)
    assert srv.proc.wait(60) == 1
    srv.stop()
    assert "the prefill instance" in srv.output().splitlines()[-1]
    assert not any(p.is_running() and p.status() != "zombie" for p in everything)


def _serves_kv(core: psutil.Process, kv_port: int) -> bool:
    """Whether core's worker listens on kv_port: the prefill instance's does."""
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == kv_port
        for worker in core.children()
        for c in worker.net_connections(kind="tcp")
    )
