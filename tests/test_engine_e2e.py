"""The reference engine against real worker processes: greedy output equals transformers'
generate, stop rules, requests joining a running batch, bad input; and the CLI's main job
on the embedded model."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from messages import SamplingParams
from tests.engine_helpers import byte_level_tokenizer
from tests.test_executor import wait_gone
from tests.tiny import cached_tiny_checkpoint
from zmqworker.frontend.errors import EngineCoreError
from zmqworker.frontend.llm import LLM

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [1, 2, 3], list(range(10, 60)), [200, 201, 7, 7]]


@functools.cache
def checkpoint_with_tokenizer() -> str:
    """A tiny Llama whose folder also holds a small byte-level tokenizer (vocab 320)."""
    path = cached_tiny_checkpoint(family="llama", num_layers=4, vocab_size=320)
    if not Path(path, "tokenizer.json").exists():
        byte_level_tokenizer().save_pretrained(path)
    return path


@functools.cache
def hf_greedy(prompt: tuple[int, ...], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint_with_tokenizer(), dtype=torch.float32
    )
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def make_llm(tp: int = 1, pp: int = 1, **kw) -> LLM:
    """The tiny Llama on the CPU in float32 (as transformers' reference runs), unless kw
    says otherwise: "auto" would take a GPU, in bfloat16, where one is visible."""
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLM(
        model=checkpoint_with_tokenizer(),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=4,
        max_model_len=96,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 24),
        kv_cache_bytes=kw.pop("kv_cache_bytes", 1 << 20),
        **kw,
    )


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """One engine of make_llm's defaults for the tests that only generate on it: none
    breaks it, and each finishes its requests, so none sees another's."""
    with make_llm() as engine:
        yield engine


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 1)])
def test_greedy_output_equals_transformers(tp, pp, request):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    if (tp, pp) == (1, 1):
        outs = request.getfixturevalue("llm").generate(PROMPTS, params)
    else:
        with make_llm(tp, pp) as llm:
            outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 10), prompt
        assert out.finish_reason == "length"


def test_max_model_len_below_the_block_size_generates_as_transformers():
    """Sequences shorter than one block: warm-up and steps stay within max_model_len."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[1, 2, 3], [*PROMPTS[0], 8]]  # 3 tokens, and all 8 of max_model_len
    with LLM(
        model=checkpoint_with_tokenizer(), block_size=16, max_model_len=8, kv_cache_bytes=1 << 20
    ) as llm:
        outs = llm.generate(prompts, params)
    assert outs[0].token_ids == hf_greedy((1, 2, 3), 5)
    assert outs[1].token_ids == hf_greedy(tuple(prompts[1]), 1)  # no room for more
    assert [o.finish_reason for o in outs] == ["length", "length"]


# 4 layers x (K,V x 4 tokens x 2 heads x 16 x fp32) = 4 KiB a block; 25 blocks (the
# 96-token max_model_len needs 24) for requests whose prompts fit (17 blocks) but that
# grow to need 48 together.
SMALL_CACHE_BYTES = 25 * 4096


@pytest.fixture(scope="module")
def small_cache() -> Iterator[LLM]:
    """An engine whose cache preempts PROMPTS' batch (async scheduling, LLM's default),
    shared by the tests that only generate on it and count their own preemptions."""
    with make_llm(kv_cache_bytes=SMALL_CACHE_BYTES) as engine:
        yield engine


def test_kv_cache_overflow_finishes_through_preemption(small_cache):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    before = small_cache.stats().num_preemptions
    outs = small_cache.generate(PROMPTS, params)
    assert small_cache.stats().num_preemptions > before
    assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 30) for p in PROMPTS]


def test_seeded_sampling_gives_the_same_tokens_through_preemption(small_cache, llm):
    """A seeded request's tokens depend on its seed and its logits alone: preempted and
    recomputed, it samples what it samples in a cache with room for every request."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
    before = small_cache.stats().num_preemptions
    pressed = small_cache.generate(PROMPTS, params)
    assert small_cache.stats().num_preemptions > before
    assert [o.token_ids for o in pressed] == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_stop_strings_and_max_tokens_are_honoured(llm):
    free = llm.generate(
        ["Hello world"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    assert len(free.token_ids) == 24 and free.finish_reason == "length"
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop, free.text
    cut = llm.generate(
        ["Hello world"],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
    )[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    short = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert len(short.token_ids) <= 3


def test_requests_arriving_while_others_run_are_batched_in(llm):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def scenario(llm: LLM) -> tuple[list[list[int]], list[bool]]:
        first_out = asyncio.Event()
        first_done = False
        joined_while_running: list[bool] = []

        async def first() -> list[int]:
            nonlocal first_done
            outputs = []
            async for out in llm.generate_stream(PROMPTS[0], long):
                outputs.append(out)
                first_out.set()
            first_done = True
            return outputs[-1].token_ids

        async def late(prompt: list[int]) -> list[int]:
            await first_out.wait()  # the first request is running: join it
            outputs = []
            async for out in llm.generate_stream(prompt, short):
                if not outputs:
                    joined_while_running.append(not first_done)
                outputs.append(out)
            return outputs[-1].token_ids

        tokens = await asyncio.gather(first(), *(late(p) for p in PROMPTS[1:]))
        return tokens, joined_while_running

    tokens, joined = asyncio.run(scenario(llm))
    assert tokens[0] == hf_greedy(tuple(PROMPTS[0]), 60)
    assert tokens[1:] == [hf_greedy(tuple(p), 8) for p in PROMPTS[1:]]
    assert joined == [True] * (len(PROMPTS) - 1)  # served while the first still ran


def test_bad_input_is_refused_and_the_engine_stays_usable(llm, tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder"):
        LLM(model=str(tmp_path / "missing"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="no prompts|empty"):
        llm.generate([], params)
    with pytest.raises(ValueError, match="max_model_len|longer"):
        llm.generate([[1] * 200], params)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=0))
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == hf_greedy(tuple(PROMPTS[0]), 4)


def test_cli_main_job_answers_paris_on_the_embedded_model():
    if shutil.which(sys.executable) is None:
        pytest.skip("no interpreter path")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zmqworker",
            "generate",
            "The capital of France is",
            "--pp",
            "2",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    assert "time to first token" in out.stderr and "tokens/s" in out.stderr


def test_cli_errors_are_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "zmqworker", "generate", "x", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("zmqworker: error:")
    assert "Traceback" not in out.stderr


def test_async_scheduling_gives_the_tokens_and_streams_of_sync_scheduling(small_cache):
    """Greedy and seeded sampling, stop tokens, stop strings, max_tokens and a cache small
    enough to preempt: the same tokens with two steps in flight as with one; a stopped
    request streams exactly its tokens, none of the step after its stop."""

    def scenario(llm: LLM) -> tuple[list, list]:
        free = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20))
        stop_token = free[0].token_ids[6]
        params = [
            SamplingParams(temperature=0.0, max_tokens=25, stop_token_ids=[stop_token]),
            SamplingParams(temperature=0.8, seed=11, max_tokens=22, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=30, stop=[free[3].text[8:11]]),
        ]

        async def stream() -> list[list[int]]:
            streamed = []
            async for out in llm.generate_stream(PROMPTS[0], params[0]):
                streamed.append(out.new_token_ids)
            return streamed

        streamed = asyncio.run(stream())
        outs = llm.generate(PROMPTS, params)
        return [(o.token_ids, o.text, o.finish_reason) for o in outs], streamed

    def preempting_scenario(llm: LLM) -> tuple[list, list]:
        before = llm.stats().num_preemptions
        result = scenario(llm)
        stats = llm.stats()
        assert stats.num_preemptions > before
        # The engine core takes the steps in flight back once every request has
        # finished, before it reads on: every block is free again.
        assert stats.num_free_blocks == stats.num_blocks
        return result

    with make_llm(kv_cache_bytes=SMALL_CACHE_BYTES, async_scheduling=False) as sync:
        results = {False: preempting_scenario(sync)}
    results[True] = preempting_scenario(small_cache)
    assert results[True] == results[False]
    (first, _, reason), streamed = results[True][0][0], results[True][1]
    assert reason == "stop" and [t for chunk in streamed for t in chunk] == first


def test_a_worker_death_with_two_steps_in_flight_fails_both_and_leaves_no_hang():
    llm = make_llm(tp=2)
    pids = llm.worker_pids
    [core_pid] = llm.engine_core_pids
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def generate() -> None:
        seen = 0
        async for _ in llm.generate_stream(PROMPTS[0], params):
            seen += 1
            if seen == 3:
                subprocess.run(["kill", "-9", str(pids[1])], check=True)

    try:
        with pytest.raises(EngineCoreError) as info:
            asyncio.run(generate())
        assert info.value.exc_type == "WorkerDiedError" and "worker rank 1 died" in str(info.value)
        with pytest.raises(EngineCoreError, match="worker rank 1"):  # at once: the run is over
            llm.generate([PROMPTS[1]], params)
        # The engine core stopped its other worker and left.
        assert wait_gone([core_pid, *pids], 10.0)
    finally:
        llm.shutdown()


def test_a_step_budget_below_a_warm_up_batch_bounds_the_warm_up_too():
    """max_num_batched_tokens under a warm-up batch size (8) holds fewer requests a step:
    the workers warm up within it, and the engine starts."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with make_llm(max_num_batched_tokens=4) as engine:
        outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 5) for p in PROMPTS]
