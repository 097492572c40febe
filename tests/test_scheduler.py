"""The scheduler and EngineCore over a fake executor whose fake workers check every delta
(see engine_helpers.FakeWorker) and whose 'model' reads the sequence back from the KV
cache, so wrong blocks give wrong tokens."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from engine_helpers import (
    FakeExecutor,
    byte_level_tokenizer,
    greedy,
    reference_tokens,
    run,
)

from messages import ModelRunnerOutput, SamplingParams, SchedulerConfig
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.core import EngineCore, num_blocks_from_memory
from zmqworker.engine.handles import HandlePool
from zmqworker.engine.request import FinishReason, Request

MAX_MODEL_LEN = 40


def make_core(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefix_caching: bool = False,
    async_scheduling: bool = False,
    **executor_args,
) -> tuple[EngineCore, FakeExecutor]:
    executor = FakeExecutor(num_blocks=num_blocks, **executor_args)
    core = EngineCore(
        executor,
        MAX_MODEL_LEN,
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    return core, executor


def step_until(core: EngineCore, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if done():
            return
        core.step()
    raise AssertionError(f"not reached after {max_steps} steps")


def expected_output(request: Request, executor: FakeExecutor) -> list[int]:
    limit = min(request.sampling_params.max_tokens, MAX_MODEL_LEN - len(request.prompt_token_ids))
    return reference_tokens(request.prompt_token_ids, limit, executor.token_fn)


def random_requests(n: int, seed: int = 0, shared_prefix: bool = False) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(50) for _ in range(12)]
    requests = []
    for i in range(n):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        if shared_prefix and i % 2:
            prompt = prefix + prompt[:3]
        requests.append(Request(f"r{i}", prompt, greedy(max_tokens=rng.randrange(1, 16))))
    return requests


def steps(executor: FakeExecutor):
    return executor.workers[-1].steps


def test_startup_order_and_num_blocks_is_the_minimum_over_ranks():
    executor = FakeExecutor(num_blocks=10, pipeline_parallel_size=2)
    per_block = [s.page_size_bytes * len(s.layer_names) for s in executor.specs]
    executor.determine_available_memory = lambda: [10 * per_block[0], 7 * per_block[1] + 5]
    core = EngineCore(executor, max_model_len=28)
    assert executor.calls == [
        "get_kv_cache_specs",
        "initialize_from_config",
        "compile_or_warm_up_model",
    ]
    config = executor.kv_cache_config
    assert config.num_blocks == 7 and core.block_manager.num_blocks == 7
    assert len(config.tensors) == 4  # one per layer over both stages
    assert all(t.size_bytes == 7 * config.groups[0].spec.page_size_bytes for t in config.tensors)


def test_kv_cache_smaller_than_max_model_len_is_refused():
    executor = FakeExecutor(num_blocks=9, block_size=4)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        EngineCore(executor, max_model_len=40)
    assert "initialize_from_config" not in executor.calls  # refused before any allocation


def test_num_blocks_from_memory_checks_its_input():
    spec = FakeExecutor().specs[0]
    with pytest.raises(ValueError, match="2 ranks reported memory but 1"):
        num_blocks_from_memory([1, 2], [spec])
    assert num_blocks_from_memory([spec.page_size_bytes * 2 * 5 + 1], [spec]) == 5
    with pytest.raises(ValueError, match="rank 1 has 10 bytes for the KV cache"):
        num_blocks_from_memory([10**6, 10], [spec, spec])


@pytest.mark.parametrize(("pp", "async_scheduling"), [(1, False), (1, True), (2, False)])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("num_blocks", [12, 64])
def test_outputs_match_the_reference(pp, async_scheduling, prefix_caching, num_blocks):
    """Tight caches preempt, pipelines and async scheduling keep two steps in flight,
    shared prefixes hit the cache; every request still gets exactly the reference tokens."""
    core, executor = make_core(
        num_blocks=num_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=10,
        prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        pipeline_parallel_size=pp,
        defer=True,
    )
    requests = random_requests(10, seed=pp + num_blocks, shared_prefix=True)
    for request in requests:
        core.add_request(request)
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor), request
        assert request.finish_reason is FinishReason.LENGTH
    if num_blocks == 12:
        assert sum(r.num_preemptions for r in requests) > 0
    if prefix_caching:
        assert sum(r.num_cached_tokens for r in requests) > 0
    assert core.block_manager.num_free_blocks == num_blocks
    for so in steps(executor):
        assert len(so.scheduled_new_reqs) + len(so.scheduled_cached_reqs) <= 4
        assert so.total_num_scheduled_tokens <= 10


def test_requests_arriving_later_are_batched_in():
    core, executor = make_core()
    first = Request("first", [1, 2, 3], greedy(max_tokens=10))
    core.add_request(first)
    for _ in range(3):
        core.step()
    second = Request("second", [4, 5], greedy(max_tokens=3))
    core.add_request(second)
    core.step()
    so = steps(executor)[-1]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["second"]
    assert so.scheduled_cached_reqs.req_handles.tolist() == [first.handle]
    assert so.scheduled_cached_reqs.num_scheduled_tokens.tolist() == [1]
    run(core)
    assert first.output_token_ids == expected_output(first, executor)
    assert second.output_token_ids == expected_output(second, executor)


def test_a_step_carries_only_the_sampling_params_the_workers_read():
    """Stop strings, bad words as text and a structured-output constraint (a JSON schema
    may be large) are the client's and the engine's: a step that carried them could pass
    the workers' bound on its body, failing every request in it."""
    core, executor = make_core()
    params = SamplingParams(
        max_tokens=3, temperature=0.0, stop=["x" * 100_000], bad_words=["y" * 1_000],
        bad_words_token_ids=[[7]], stop_token_ids=[9],
    )  # fmt: skip
    request = Request("r", [1, 2, 3], params)
    core.add_request(request)
    core.step()
    [new] = steps(executor)[-1].scheduled_new_reqs
    sent = new.sampling_params
    assert sent.stop == [] and sent.bad_words == [] and sent.structured_outputs is None
    assert (sent.bad_words_token_ids, sent.stop_token_ids) == ([[7]], [9])
    assert request.sampling_params is params  # the engine's own stays whole
    plain = SamplingParams(max_tokens=3)
    assert plain.for_workers() is plain


@pytest.mark.parametrize("prompt_len", [5, 6, 9])
def test_every_prompt_token_counts_as_prefill_however_the_chunks_fall(prompt_len):
    """A chunk that left one token sent it as a decode, uncounted (the prefill_tokens
    metric ran short)."""
    core, _ = make_core(max_num_batched_tokens=4)
    core.add_request(Request("r", list(range(1, prompt_len + 1)), greedy(max_tokens=2)))
    run(core)
    assert core.stats().num_prefill_tokens == prompt_len


def test_long_prompt_is_prefilled_in_chunks_after_the_decodes():
    core, executor = make_core(max_num_batched_tokens=8)
    decoding = Request("decoding", [1, 2], greedy(max_tokens=20))
    core.add_request(decoding)
    core.step()
    long = Request("long", list(range(3, 23)), greedy(max_tokens=2))
    core.add_request(long)
    chunks, outputs = [], []
    for _ in range(3):
        core.step()
        so = steps(executor)[-1]
        cached = so.scheduled_cached_reqs
        # The decode comes first and takes one token of the budget.
        assert cached.req_handles.tolist()[0] == decoding.handle
        assert cached.num_scheduled_tokens.tolist()[0] == 1
        assert so.total_num_scheduled_tokens <= 8
        new = [r.num_scheduled_tokens for r in so.scheduled_new_reqs]
        chunks += new + cached.num_scheduled_tokens.tolist()[1:]
        outputs.append(long.output_token_ids[:])
    assert chunks == [7, 7, 6]
    assert outputs == [[], [], long.output_token_ids[:1]]  # nothing sampled mid-prefill
    run(core)
    assert long.output_token_ids == expected_output(long, executor)
    assert decoding.output_token_ids == expected_output(decoding, executor)


def test_preemption_frees_the_newest_and_restarts_it_with_its_outputs():
    # 10 blocks of 4: three requests of 10 prompt tokens need 3 blocks each, then more.
    core, executor = make_core(num_blocks=10, max_num_batched_tokens=64)
    requests = [Request(f"r{i}", list(range(i, i + 10)), greedy(max_tokens=20)) for i in range(3)]
    for request in requests:
        core.add_request(request)
    step_until(core, lambda: steps(executor) and steps(executor)[-1].preempted_req_handles)
    preempted_step = len(steps(executor)) - 1
    newest = requests[-1]
    so = steps(executor)[preempted_step]
    assert so.preempted_req_handles == [newest.handle]
    assert newest.num_preemptions == 1 and newest.handle not in so.scheduled_cached_reqs.req_handles
    outputs_so_far = list(newest.output_token_ids)
    assert outputs_so_far  # it had decoded before being preempted
    step_until(core, lambda: "r2" in [r.req_id for r in steps(executor)[-1].scheduled_new_reqs])
    restart = next(r for r in steps(executor)[-1].scheduled_new_reqs if r.req_id == "r2")
    assert restart.prompt_token_ids.tolist() == newest.prompt_token_ids + outputs_so_far
    assert restart.req_handle == so.preempted_req_handles[0]  # kept through the preemption
    run(core)
    for request in requests:
        assert request.output_token_ids == expected_output(request, executor)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_never_takes_the_blocks_of_an_older_request(async_scheduling):
    # A cache of 10 blocks for three requests that outgrow it: the first to arrive is the
    # oldest all its life, so no request may preempt it. With async scheduling a request
    # in flight that lacks a block waits for the newer ones' steps; it used to preempt
    # an idle older one (one waiting for those steps itself).
    for seed in range(40):
        rng = random.Random(seed)
        core, executor = make_core(num_blocks=10, max_num_seqs=4,
                                   async_scheduling=async_scheduling)  # fmt: skip
        prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(3)]
        requests = [
            Request(f"r{i}", prompt, greedy(max_tokens=rng.randint(5, 20)))
            for i, prompt in enumerate(prompts)
        ]
        for request in requests:
            core.add_request(request)
        run(core)
        assert requests[0].num_preemptions == 0, f"seed {seed}"
        for request in requests:
            assert request.output_token_ids == expected_output(request, executor), f"seed {seed}"
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_finished_handles_are_reported_once_and_blocks_freed():
    core, executor = make_core(max_num_seqs=3)
    requests = random_requests(8, seed=3)
    for request in requests:
        core.add_request(request)
    run(core)
    core.add_request(Request("last", [1], greedy(max_tokens=1)))
    run(core)  # its step carries the last finishes
    reported = [h for so in steps(executor) for h in so.finished_req_handles]
    handles_of = {}
    for so in steps(executor):
        for new in so.scheduled_new_reqs:
            handles_of.setdefault(new.req_id, new.req_handle)
    assert sorted(reported) == sorted(handles_of[r.req_id] for r in requests)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    # Handles are reused once their finish has come back: they stay small.
    assert max(handles_of.values()) < 3 + 3


def test_stop_token_ids_and_max_tokens_are_honoured():
    tok = byte_level_tokenizer()
    script = tok.encode(" Paris. The end. And more text after it")
    prompt = tok.encode("The capital of France is")
    period = tok.encode(".")[0]

    def token_fn(seq):
        return script[(len(seq) - len(prompt)) % len(script)]

    core, executor = make_core(token_fn=token_fn)

    def request(req_id, **params):
        return Request(req_id, prompt, SamplingParams(temperature=0.0, **params))

    stopped = request("stopped", stop_token_ids=[period], max_tokens=30)
    limited = request("limited", max_tokens=3)
    for r in (stopped, limited):
        core.add_request(r)
    run(core)
    assert tok.decode(stopped.output_token_ids) == " Paris."
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == period
    [sent] = client_outputs(0, [stopped], core.stats()).finished
    assert sent.finish_reason == "stop" and sent.stop_reason == period
    assert len(limited.output_token_ids) == 3 and limited.finish_reason is FinishReason.LENGTH
    assert limited.output_token_ids == script[:3]
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_abort_waiting_running_and_in_flight_requests():
    core, executor = make_core(max_num_seqs=2, pipeline_parallel_size=2, defer=True)
    a, b, c = (Request(n, [1, 2, 3], greedy(max_tokens=30)) for n in "abc")
    for r in (a, b, c):
        core.add_request(r)
    core.step()  # sends a step with a and b, and keeps it in flight
    assert executor.pending and not a.output_token_ids
    handle_a = a.handle
    assert core.abort_request("c").finish_reason is FinishReason.ABORT  # waiting
    assert core.abort_request("a").finish_reason is FinishReason.ABORT  # in flight
    assert core.abort_request("a") is None
    step_until(core, lambda: len(b.output_token_ids) >= 2)
    assert a.output_token_ids == []  # the in-flight token for a was dropped
    assert any(handle_a in so.finished_req_handles for so in steps(executor))
    assert core.abort_request("b") is b  # running, between steps
    core.add_request(Request("d", [4], greedy(max_tokens=2)))
    run(core)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_a_failed_step_aborts_everything_and_the_engine_goes_on():
    core, executor = make_core(max_num_seqs=4)
    requests = random_requests(6, seed=5)
    for request in requests:
        core.add_request(request)
    for _ in range(3):
        core.step()
    run_step = executor._run

    def fail(so):
        raise RuntimeError("rank 0: boom")

    executor._run = fail
    with pytest.raises(RuntimeError, match="boom"):
        core.step()
    executor._run = run_step
    assert all(r.finish_reason is FinishReason.ABORT for r in requests)
    assert not core.has_work()
    kv = core.block_manager
    assert kv.num_free_blocks == kv.num_blocks
    for worker in executor.workers:
        worker.strict_finished = False  # the failed step never reached them
    live = {h for w in executor.workers for h in w.reqs}
    after = Request("after", [3, 1, 4], greedy(max_tokens=5))
    core.add_request(after)
    run(core)
    assert after.output_token_ids == expected_output(after, executor)
    first = steps(executor)[-5]
    assert first.scheduled_new_reqs[0].req_id == "after"
    assert live <= set(first.finished_req_handles)  # the workers drop what they held
    # Nothing of the failed requests is left in the workers.
    assert [state.req_id for state in executor.workers[-1].reqs.values()] == ["after"]


def test_bad_requests_and_outputs_are_refused():
    core, executor = make_core()
    with pytest.raises(ValueError, match="longer than max_model_len"):
        core.add_request(Request("long", [1] * (MAX_MODEL_LEN + 1), greedy()))
    core.add_request(Request("x", [1, 2, 3, 4, 5], greedy()))
    with pytest.raises(ValueError, match="already in the scheduler"):
        core.add_request(Request("x", [1], greedy()))
    scheduler = core.scheduler
    so = scheduler.schedule()
    handle = so.scheduled_new_reqs[0].req_handle

    def output(handles, tokens):
        return ModelRunnerOutput(np.array(handles, np.int32), np.array(tokens, np.int32))

    with pytest.raises(RuntimeError, match="in the order"):
        scheduler.update_from_output(msgspec.structs.replace(so), output([handle], [1]))
    with pytest.raises(RuntimeError, match="the step scheduled"):
        scheduler.update_from_output(so, output([handle + 1], [1]))


def test_token_for_a_request_mid_prefill_is_refused():
    core, _ = make_core(max_num_batched_tokens=2)
    core.add_request(Request("x", [1, 2, 3, 4, 5], greedy()))
    so = core.scheduler.schedule()
    handle = so.scheduled_new_reqs[0].req_handle
    bad = ModelRunnerOutput(np.array([handle], np.int32), np.array([7], np.int32))
    with pytest.raises(RuntimeError, match="middle of its prefill"):
        core.scheduler.update_from_output(so, bad)


def test_handle_pool_reuses_smallest_released_handle():
    pool = HandlePool()
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]
    pool.release([1, 0])
    assert pool.acquire() == 0 and pool.acquire() == 1 and pool.acquire() == 3
    with pytest.raises(RuntimeError, match="not live"):
        pool.release([7])


def test_a_request_with_max_uncached_tokens_runs_only_where_its_prompt_is_cached():
    """A request sent with max_uncached_tokens (a disaggregated router's prompt for a
    decode instance to compute) is declined unrun where more of its prompt than that is
    uncached when it is first scheduled: finished, the reason naming the numbers, no
    step, block or handle taken. Where the prefix cache holds the rest, it runs as any
    other; a restart (preempted) always runs; the limit comes with no other mode."""
    core, executor = make_core(prefix_caching=True)
    prompt = list(range(1, 14))  # 3 full blocks of 4, and a token
    cold = Request("cold", prompt, greedy(max_tokens=3), max_uncached_tokens=4)
    core.add_request(cold)
    run(core)
    assert list(core.scheduler.declined) == [cold] and cold.finish_reason is FinishReason.DECLINED
    assert cold.error == (
        "request 'cold': 13 of its 13 prompt tokens are not cached here, more than "
        "max_uncached_tokens=4; it was not run"
    )
    assert not steps(executor) and cold.handle is None and not core.num_unfinished
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    core.scheduler.declined.clear()
    core.add_request(Request("warm", prompt, greedy(max_tokens=3)))
    run(core)
    again = Request("again", [*prompt, 20], greedy(max_tokens=3), max_uncached_tokens=4)
    core.add_request(again)
    run(core)  # 12 of its 14 tokens cached: 2 to compute
    assert not core.scheduler.declined and again.num_cached_tokens == 12
    assert again.output_token_ids == expected_output(again, executor)
    restart = Request("restart", prompt, greedy(), max_uncached_tokens=1)
    assert restart.declines(0) is not None
    restart.num_preemptions = 1
    assert restart.declines(0) is None
    whole = SamplingParams(temperature=0.0, prompt_logprobs=1)
    reason = Request("whole", prompt, whole, max_uncached_tokens=4).declines(0)
    assert "13 of its 13 prompt tokens are to compute here (it asks for prompt logprobs" in reason
    with pytest.raises(ValueError, match="give at most one of remote_decode, a remote prefill"):
        Request("both", prompt, greedy(), remote_decode=True, max_uncached_tokens=4)
    with pytest.raises(ValueError, match="max_uncached_tokens must be >= 1, got 0"):
        Request("zero", prompt, greedy(), max_uncached_tokens=0)
