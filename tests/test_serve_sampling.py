"""zmqworker serve with two API server processes, called with the official openai client:
n > 1 choices (completions and chat, streamed and not, seeds, the prompt and its
prompt logprobs computed once), vLLM's request fields beyond OpenAI's, and /metrics
under vLLM's names, added up over both API servers; then SIGTERM drains the request in
flight and stops everything.
The server is the one test_serve.py uses too (conftest.py): the last test here stops it."""

from __future__ import annotations

import re
import signal
from collections import defaultdict
from pathlib import Path

import openai
import psutil
import pytest
from prometheus_client.mmap_dict import MmapedDict

from tests.float_tree import approx_tree
from tests.test_serve import MODEL, Server, get

PROMPT_IDS = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 and 8 more
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(two_api_servers):
    return two_api_servers


def scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics by its name and labels, as written."""
    _, text = get(f"{server.base}/metrics")
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^([a-z0-9_:]+(?:\{[^}]*\})?) ([\d.e+-]+)$", text, re.M)
    }


def test_n_completions_share_the_prompt_and_are_seeded_per_choice(server):
    client = server.client()
    args = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 1.0}
    before = server.wait_idle()["prefill_tokens_total"]
    seeded = client.completions.create(**args, n=4, seed=7)
    after = server.wait_idle()["prefill_tokens_total"]
    # Computed once whole, then by each other choice what its two full blocks leave.
    assert after - before == 40 + 3 * 8
    assert [c.index for c in seeded.choices] == [0, 1, 2, 3]
    assert len({c.text for c in seeded.choices}) == 4
    assert seeded.usage.prompt_tokens == 40  # once, as vLLM counts it
    assert seeded.usage.completion_tokens == 16
    again = client.completions.create(**args, n=4, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in seeded.choices]
    # Choice i is the n=1 request seeded 7 + i; prompts are numbered prompt * n + i.
    alone = client.completions.create(**args, seed=9)
    assert alone.choices[0].text == seeded.choices[2].text
    two = client.completions.create(**{**args, "prompt": [PROMPT_IDS, PROMPT_IDS[:20]]}, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.prompt_tokens == 60
    texts: dict[int, str] = defaultdict(str)
    stream = client.completions.create(
        **args, n=3, seed=7, stream=True, stream_options={"include_usage": True}
    )
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and [texts[i] for i in range(3)] == [
        c.text for c in seeded.choices[:3]
    ]
    assert usage.prompt_tokens == 40 and usage.completion_tokens == 12
    best_of = client.completions.create(**args, n=2, extra_body={"best_of": 2})
    assert len(best_of.choices) == 2


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(server):
    client = server.client()
    args = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 1.0, "seed": 3}
    before = server.wait_idle()["prefill_tokens_total"]
    best = client.completions.create(**args, n=2, extra_body={"best_of": 4})
    assert server.wait_idle()["prefill_tokens_total"] - before == 40 + 3 * 8  # shared
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(c.text) > 0 for c in best.choices) * 4
    # No prefix cache: the blocks the samples share with the first are not hits.
    assert best.usage.prompt_tokens_details.cached_tokens == 0
    # The four samples best_of ranked: the n=4 choices of the same seed.
    four = client.completions.create(**args, n=4, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in four.choices]
    ranked = sorted(range(4), key=lambda i: -sums[i])
    assert [c.text for c in best.choices] == [four.choices[i].text for i in ranked[:2]]
    again = client.completions.create(**args, n=2, logprobs=1, extra_body={"best_of": 4})
    assert [c.text for c in again.choices] == [c.text for c in best.choices]
    # Float sums of a forward in another batch's shape: equal up to rounding.
    assert [sum(c.logprobs.token_logprobs) for c in again.choices] == pytest.approx(
        [sums[i] for i in ranked[:2]], abs=1e-3
    )


def test_n_choices_with_prompt_logprobs_prefill_once_and_each_carries_them(server):
    client = server.client()
    args = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 1.0}
    asked = {"prompt_logprobs": 2}
    before = server.wait_idle()["prefill_tokens_total"]
    four = client.completions.create(**args, n=4, seed=5, extra_body=asked)
    # The first choice computes the prompt and its logprobs; the others share its blocks.
    assert server.wait_idle()["prefill_tokens_total"] - before == 40 + 3 * 8
    alone = client.completions.create(**args, extra_body=asked)
    expected = alone.choices[0].model_extra["prompt_logprobs"]
    assert len(expected) == 40 and expected[0] is None
    got = [c.model_extra["prompt_logprobs"] for c in four.choices]
    assert got == approx_tree([expected] * 4)
    plain = client.completions.create(**args, n=4, seed=5)
    assert [c.text for c in four.choices] == [c.text for c in plain.choices]
    best = client.completions.create(**args, n=2, extra_body={**asked, "best_of": 3})
    got = [c.model_extra["prompt_logprobs"] for c in best.choices]
    assert got == approx_tree([expected] * 2)


def test_n_chat_choices_greedy_are_equal_and_stream_by_index(server):
    client = server.client()
    args = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**args, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 1
    assert whole.usage.completion_tokens == 18
    texts: dict[int, str] = defaultdict(str)
    roles = set()
    for chunk in client.chat.completions.create(**args, n=3, stream=True):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [whole.choices[0].message.content] * 3


def test_a_client_gone_aborts_every_choice(server):
    client = server.client(max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=400, n=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    metrics = server.wait_idle()
    assert metrics["num_requests_running"] == 0 and metrics["kv_cache_blocks_used"] == 0


def test_include_stop_str_in_output_and_skip_special_tokens(server):
    client = server.client()
    base = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}
    cut = client.completions.create(**base, max_tokens=12, stop=["."])
    kept = client.completions.create(
        **base, max_tokens=12, stop=["."], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == cut.choices[0].text + "."
    # <|im_start|> (token 1), a special token, forced by logit_bias.
    forced = {**base, "max_tokens": 2, "logit_bias": {"1": 100}}
    assert client.completions.create(**forced).choices[0].text == ""
    shown = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|><|im_start|>"


def test_chat_template_options(server):
    client = server.client()
    args = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    usual = client.chat.completions.create(**args, messages=CHAT)
    bare = client.chat.completions.create(
        **args, messages=CHAT, extra_body={"add_generation_prompt": False}
    )
    # "<|im_start|>assistant\n" is 4 tokens.
    assert bare.usage.prompt_tokens == usual.usage.prompt_tokens - 4
    via_kwargs = client.chat.completions.create(
        **args, messages=CHAT, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
    )
    assert via_kwargs.usage.prompt_tokens == bare.usage.prompt_tokens
    go_on = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
    continued = client.chat.completions.create(
        **args,
        messages=go_on,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert continued.choices[0].message.content.startswith(" Paris")
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            **args, messages=go_on, extra_body={"continue_final_message": True}
        )
    assert both.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as reserved:
        client.chat.completions.create(
            **args, messages=CHAT, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    assert reserved.value.body["param"] == "chat_template_kwargs"
    assert "'tokenize' is an argument" in reserved.value.body["message"]


def metrics_folder(server: Server) -> Path:
    [folder] = {
        p.environ()["PROMETHEUS_MULTIPROC_DIR"]
        for p in psutil.Process(server.proc.pid).children()
        if "zmqworker.serve.api_server" in p.cmdline()
    }
    return Path(folder)


def servers_that_generated(folder: Path) -> int:
    """API servers whose own file counts generated tokens (each writes its series, at 0,
    as it starts)."""
    return sum(
        any(
            "vllm:generation_tokens" in key and value > 0
            for key, value, *_ in MmapedDict.read_all_values_from_file(str(file))
        )
        for file in folder.glob("counter_*.db")
    )


def test_metrics_under_vllm_s_names_add_up_over_the_api_servers(server):
    label = f'{{model_name="{MODEL}"}}'
    folder = metrics_folder(server)
    before = scrape(server)
    done = 0
    # A new connection each, until both API servers have answered some (their files).
    while done < 4 or servers_that_generated(folder) < 2:
        assert done < 30, "the kernel gave every connection to one API server"
        server.client().completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0
        )
        done += 1
    server.wait_idle()
    after = scrape(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f"vllm:prompt_tokens_total{label}") == done * 40
    assert grew(f"vllm:prefix_cache_queries_total{label}") == done * 40
    assert grew(f"vllm:prefix_cache_hits_total{label}") == 0  # no prefix cache here
    assert grew(f"vllm:generation_tokens_total{label}") == done * 3
    assert grew(f"vllm:time_to_first_token_seconds_count{label}") == done
    assert grew(f"vllm:request_queue_time_seconds_count{label}") == done
    assert grew(f"vllm:e2e_request_latency_seconds_count{label}") == done
    assert grew(f"vllm:inter_token_latency_seconds_count{label}") == done * 2
    reason = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert grew(reason) == done
    assert after[f"vllm:num_requests_running{label}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{label}"] == 0
    assert after[f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{MODEL}"}}'] > 0


def test_sigterm_drains_the_requests_in_flight_then_stops_the_workers_and_the_metrics(server):
    """Last: it stops the shared server. The stream in flight gets every token; the
    workers exit and the metrics folder goes."""
    folder = metrics_folder(server)
    assert folder.is_dir()
    stream = server.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [next(iter(stream))]
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert sum(1 for c in chunks if c.choices[0].text) == 12  # every token, then the end
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.stop() == 0, server.output()[-2000:]
    assert server.workers and not any(psutil.pid_exists(pid) for pid in server.workers)
    assert "stopping the workers" in server.output()
    assert not folder.exists()
