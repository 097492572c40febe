"""n > 1: the samples of one prompt are requests that share its KV. In the engine core
over a fake executor whose 'model' reads the sequence back from the KV cache (so a wrong
shared block gives wrong tokens), and through the LLM on a tiny real model: seeds,
greedy samples, the prefill counter, aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest

from messages import SamplingParams
from tests.float_tree import approx_tree, plain_tree
from tests.test_engine_e2e import make_llm
from tests.test_scheduler import expected_output, greedy, make_core, run
from zmqworker.engine.request import Request
from zmqworker.frontend.llm import LLM

BLOCK = 4  # the fake executor's block size


def siblings(prompt: list[int], n: int, max_tokens: int = 6, tag: str = "p") -> list[Request]:
    first = f"{tag}.0"
    return [
        Request(f"{tag}.{i}", prompt, greedy(max_tokens), shares_prompt_with=first if i else None)
        for i in range(n)
    ]


def shared_tokens(prompt_len: int) -> int:
    return (prompt_len - 1) // BLOCK * BLOCK


@pytest.mark.parametrize(("pp", "async_scheduling"), [(1, False), (1, True), (2, False)])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("prompt_len", [4, 5, 14])
def test_siblings_compute_the_prompt_once_and_get_the_reference_tokens(
    pp, async_scheduling, prefix_caching, prompt_len
):
    core, executor = make_core(
        max_num_batched_tokens=16,
        prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pp,
        defer=True,
    )
    prompt = [(7 * i + 3) % 50 for i in range(prompt_len)]
    requests = siblings(prompt, 4)
    for request in requests:
        core.add_request(request)
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor), request
    # The first computes the prompt, each other one what the full blocks leave.
    computed = prompt_len + 3 * (prompt_len - shared_tokens(prompt_len))
    assert core.stats().num_prefill_tokens == computed
    assert core.block_manager.num_free_blocks == 64


def test_a_sibling_with_another_prompt_or_preempted_computes_its_own():
    core, executor = make_core(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=10)
    prompt = list(range(1, 14))
    liar = Request("q.1", [9, *prompt[1:]], greedy(10), shares_prompt_with="p.0")
    requests = [*siblings(prompt, 3, max_tokens=20), liar]
    for request in requests:
        core.add_request(request)
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor), request
    assert liar.num_cached_tokens == 0
    assert sum(r.num_preemptions for r in requests) > 0  # 12 blocks cannot hold them all
    assert core.block_manager.num_free_blocks == 12


def test_samples_started_after_new_weights_compute_their_prompt():
    """A reset of the prefix cache (new weights) between the first sample's prefill and
    the others' start: they compute the prompt themselves, not take its old KV."""
    core, executor = make_core(max_num_batched_tokens=16)
    prompt = [(5 * i + 2) % 50 for i in range(14)]
    requests = siblings(prompt, 3)
    for request in requests:
        core.add_request(request)
    core.step()  # the first's prompt, whole; the others wait for it
    assert [bool(r.output_token_ids) for r in requests] == [True, False, False]
    core.reset_prefix_cache()
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor), request
    assert core.stats().num_prefill_tokens == 3 * len(prompt)
    assert core.block_manager.num_free_blocks == 64


# Four prompts of three samples each, with which 21 blocks preempt a sample after its
# first one while both steps in flight hold requests (found by a seeded search).
PREEMPTED_PROMPTS = [
    [4, 8, 11, 9, 40, 43, 29, 1, 4, 16, 21, 31, 23, 13, 7, 34, 36, 1, 5],
    [19, 44, 25, 21, 21, 33, 29, 8, 36, 37, 47],
    [14, 15, 32, 32, 34, 43, 14, 46, 0, 3, 48, 47, 14, 6, 15, 2, 44, 33, 29],
    [23, 9, 38, 23, 1, 12, 35],
]


def test_a_sample_preempted_after_its_first_one_does_not_wait_for_it():
    """Preempted last, a sample waits ahead of its first one: it computes the prompt
    itself rather than wait for the first to run, which held the queue for ever with
    nothing running (two steps in flight: pipeline stages)."""
    core, executor = make_core(
        num_blocks=21, max_num_batched_tokens=10, pipeline_parallel_size=2, defer=True
    )
    requests = [r for i, p in enumerate(PREEMPTED_PROMPTS) for r in siblings(p, 3, 12, f"p{i}")]
    for request in requests:
        core.add_request(request)
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor), request
    assert sum(r.num_preemptions for r in requests) > 0
    assert core.block_manager.num_free_blocks == 21


def test_a_sample_waiting_for_its_first_holds_no_other_request_back():
    """A sample waits while its first one computes their prompt; the requests behind it
    start meanwhile (they waited for the whole prompt, every other step empty)."""
    core, _ = make_core(max_num_batched_tokens=8, pipeline_parallel_size=2, defer=True)
    for request in [*siblings(list(range(36)), 2, max_tokens=2), Request("t", [1, 2], greedy(2))]:
        core.add_request(request)
    started = []
    for _ in range(2):  # both stages' first steps: nothing comes back in between
        step = core.scheduler.schedule()
        started.append([r.req_id for r in step.scheduled_new_reqs])
        core.batch_queue.submit(step)
    assert started == [["p.0"], ["t"]]
    run(core)
    assert core.block_manager.num_free_blocks == 64


def test_aborting_siblings_frees_every_block():
    core, _ = make_core()
    requests = siblings(list(range(1, 11)), 3, max_tokens=30)
    for request in requests:
        core.add_request(request)
    for _ in range(4):
        core.step()
    assert core.block_manager.num_free_blocks < 64
    for request in requests:
        core.abort_request(request.req_id)
    run(core)
    assert core.block_manager.num_free_blocks == 64


def test_the_engine_core_refuses_n_above_one():
    with pytest.raises(ValueError, match="n=2; the engine core runs one sample per request"):
        Request("r", [1, 2], SamplingParams(n=2))


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with make_llm() as engine:
        yield engine


PROMPT = [5, 17, 42, 9, 100, 3, 77, 12, 8, 30, 31]


def test_n_seeded_samples_are_reproducible_distinct_and_prefill_the_prompt_once(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, n=4)
    before = llm.stats().num_prefill_tokens
    first = llm.generate([PROMPT], params)
    after = llm.stats().num_prefill_tokens
    assert [o.index for o in first] == [0, 1, 2, 3]
    # block_size 4: the 8 tokens of full blocks once, the last 3 by each sample.
    assert after - before == len(PROMPT) + 3 * (len(PROMPT) - 8)
    again = llm.generate([PROMPT], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert len({tuple(o.token_ids) for o in first}) == 4
    # Sample i is the n=1 request seeded seed + i.
    alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=1236, max_tokens=8))
    assert alone[0].token_ids == first[2].token_ids


def test_greedy_samples_are_equal_and_prompts_keep_their_order(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, n=3)
    outs = llm.generate([PROMPT, [1, 2, 3]], params)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 1
    assert len({tuple(o.token_ids) for o in outs[3:]}) == 1
    assert outs[0].prompt_token_ids == PROMPT and outs[3].prompt_token_ids == [1, 2, 3]


def test_a_stream_of_n_samples_closed_early_aborts_them_all(llm):
    async def main() -> set[int]:
        params = SamplingParams(temperature=1.0, max_tokens=60, n=3, ignore_eos=True)
        seen = set()
        stream = llm.generate_stream(PROMPT, params)
        async for out in stream:
            seen.add(out.index)
            if len(seen) == 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(main()) == {0, 1, 2}
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_n_samples_with_prompt_logprobs_prefill_once_and_each_carries_them(llm):
    """Only the first sample computes the prompt logprobs (and the whole prompt); the
    others take its KV as without them, and each output carries the one computation."""
    plain = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, n=4)
    params = msgspec.structs.replace(plain, prompt_logprobs=2)
    before = llm.stats().num_prefill_tokens
    outs = llm.generate([PROMPT], params)
    assert llm.stats().num_prefill_tokens - before == len(PROMPT) + 3 * (len(PROMPT) - 8)
    alone = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert alone.prompt_logprobs is not None and len(alone.prompt_logprobs) == len(PROMPT)
    for out in outs:
        assert plain_tree(out.prompt_logprobs) == approx_tree(alone.prompt_logprobs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate([PROMPT], plain)]
