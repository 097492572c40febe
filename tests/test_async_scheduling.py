"""Async scheduling: with one pipeline stage the engine keeps several steps in flight,
each going on from the one before (a placeholder for the token that one samples). Tokens
must equal those of synchronous scheduling, a request that stops never shows a token of
the step after, and blocks and handles all come back; the workers fill placeholders
from their own samples, on both forward paths."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from engine_helpers import FakeExecutor, byte_level_tokenizer, reference_tokens

from messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.runner_helpers import GREEDY, NUM_BLOCKS, checkpoint, hf_greedy, make_runner, wire
from tests.tiny import cached_tiny_checkpoint
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.core import ASYNC_STEPS_IN_FLIGHT, EngineCore
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.scheduler import Scheduler

MAX_MODEL_LEN = 40


def make_core(
    async_scheduling: bool = True,
    num_blocks: int = 64,
    prefix_caching: bool = False,
    depth: int = ASYNC_STEPS_IN_FLIGHT,
    **kwargs,
) -> EngineCore:
    executor = FakeExecutor(num_blocks=num_blocks, defer=True, **kwargs)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12)
    return EngineCore(
        executor,
        MAX_MODEL_LEN,
        config,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        async_steps_in_flight=depth,
    )


def run(core: EngineCore, abort_at: dict[int, str] | None = None) -> int:
    """Step until done, aborting abort_at[n] before step n; the number of steps."""
    for n in range(5000):
        if abort_at and n in abort_at:
            core.abort_request(abort_at[n])
        if not core.has_work():
            return n
        core.step()
    raise AssertionError("still busy after 5000 steps")


def sent(core: EngineCore) -> list[SchedulerOutput]:
    return core.executor.workers[-1].steps


def expected(request: Request, token_fn, stop: set[int] = frozenset()) -> list[int]:
    """The reference tokens, up to max_tokens, max_model_len or a stop token (kept)."""
    limit = min(request.sampling_params.max_tokens, MAX_MODEL_LEN - len(request.prompt_token_ids))
    tokens = reference_tokens(request.prompt_token_ids, limit, token_fn)
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1]
    return tokens


def test_the_next_step_goes_on_from_the_step_in_flight():
    core = make_core()
    assert core.async_scheduling
    assert core.batch_queue.max_concurrent_batches == ASYNC_STEPS_IN_FLIGHT
    requests = [Request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=8)) for i in range(3)]
    for request in requests:
        core.add_request(request)
    run(core)
    executor = core.executor
    for request in requests:
        assert request.output_token_ids == expected(request, executor.token_fn)
    continued = 0
    for so, in_flight in zip(sent(core), executor.in_flight_at_submit, strict=True):
        cached = so.scheduled_cached_reqs
        shared = set(cached.req_handles.tolist()) & set().union(*in_flight)
        for handle, placeholders in zip(
            cached.req_handles.tolist(), cached.num_placeholders.tolist(), strict=True
        ):
            assert placeholders == (handle in shared)
        continued += bool(shared)
    # Every decode step but the first of each wave went out on top of another.
    assert continued >= 5
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_give_the_tokens_of_synchronous_scheduling(seed):
    """Mixed prefills and decodes, chunked prompts, stop tokens, max_tokens, a cache
    small enough to preempt, prefix caching: async and sync give the same tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(50) for _ in range(9)]
    specs = []
    for i in range(10):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 18))]
        if i % 3 == 0:
            prompt = prefix + prompt[:4]
        stop = [rng.randrange(50)] if i % 2 else []
        specs.append((f"r{i}", prompt, rng.randrange(1, 20), stop))
    results = {}
    for async_scheduling in (False, True):
        core = make_core(async_scheduling, num_blocks=11, prefix_caching=True)
        requests = [
            Request(req_id, prompt, SamplingParams(max_tokens=n, stop_token_ids=stop))
            for req_id, prompt, n, stop in specs
        ]
        for request in requests:
            core.add_request(request)
        run(core)
        token_fn = core.executor.token_fn
        for request, (_, _, _, stop) in zip(requests, specs, strict=True):
            assert request.output_token_ids == expected(request, token_fn, set(stop)), request
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        assert sum(r.num_preemptions for r in requests) > 0
        results[async_scheduling] = [r.output_token_ids for r in requests]
    assert results[True] == results[False]


@pytest.mark.parametrize("depth", [2, 3])
def test_a_stopped_request_shows_nothing_of_the_steps_after_and_frees_its_blocks_then(depth):
    tok = byte_level_tokenizer()
    prompt = tok.encode("The capital of France is")
    script = tok.encode(" Paris. The end. And more text after it")
    core = make_core(
        depth=depth, token_fn=lambda seq: script[(len(seq) - len(prompt)) % len(script)]
    )
    period = tok.encode(".")[0]
    stopped = Request("stopped", prompt, SamplingParams(stop_token_ids=[period], max_tokens=30))
    core.add_request(stopped)
    kv = core.block_manager
    while not stopped.is_finished:
        core.step()
    # The steps after the stop are still in flight, computing it: its blocks wait for them.
    assert len(core.batch_queue) == depth - 1 and kv.num_free_blocks < kv.num_blocks
    tokens = list(stopped.output_token_ids)
    run(core)
    assert stopped.output_token_ids == tokens and tok.decode(tokens) == " Paris."
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == period
    assert kv.num_free_blocks == kv.num_blocks
    # The next step tells the workers, once; then nothing is left in them.
    core.add_request(Request("next", [1], SamplingParams(max_tokens=1)))
    run(core)
    handles = [h for so in sent(core) for h in so.finished_req_handles]
    assert handles == [sent(core)[0].scheduled_new_reqs[0].req_handle]
    assert [s.req_id for s in core.executor.workers[-1].reqs.values()] == ["next"]


@pytest.mark.parametrize("depth", [2, 3])
def test_max_tokens_is_foreseen_and_an_abort_drops_the_steps_in_flight(depth):
    core = make_core(depth=depth)
    short = Request("short", [1, 2], SamplingParams(max_tokens=1))
    long = Request("long", [3, 4], SamplingParams(max_tokens=30))
    for request in (short, long):
        core.add_request(request)
    for _ in range(depth):
        core.step()
    # short samples its one token in the first step: the others go on with long alone.
    [first], [(second, _), *rest] = sent(core), core.executor.pending
    assert len(rest) == depth - 2
    assert len(first.scheduled_new_reqs) == 2
    assert second.scheduled_cached_reqs.req_handles.tolist() == [long.handle]
    assert second.scheduled_cached_reqs.num_placeholders.tolist() == [1]
    while len(long.output_token_ids) < 3:
        core.step()
    assert len(core.batch_queue) == depth - 1  # steps computing long are in flight
    assert core.abort_request("long") is long
    tokens = list(long.output_token_ids)
    run(core)
    assert long.output_token_ids == tokens and long.finish_reason is FinishReason.ABORT
    assert short.output_token_ids == expected(short, core.executor.token_fn)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.parametrize("depth", [2, 3])
def test_a_failure_with_steps_in_flight_fails_them_all_and_the_engine_goes_on(depth):
    core = make_core(depth=depth)
    requests = [Request(f"r{i}", [i + 1, 5], SamplingParams(max_tokens=20)) for i in range(3)]
    for request in requests:
        core.add_request(request)
    executor = core.executor
    while not sent(core) or len(core.batch_queue) < depth - 1:
        core.step()
    assert len(core.batch_queue) == depth - 1 and len(executor.pending) == depth - 1
    run_step = executor._run
    failed = []

    def fail(so):
        failed.append(so)
        raise RuntimeError("rank 0 died")

    executor._run = fail
    with pytest.raises(RuntimeError, match="rank 0 died"):
        core.step()  # sends one more step, then waits for the oldest
    executor._run = run_step
    assert len(failed) == depth and executor.in_flight_at_submit[-1]  # every step failed
    assert len(core.batch_queue) == 0 and not core.has_work()
    assert all(r.finish_reason is FinishReason.ABORT for r in requests)
    kv = core.block_manager
    assert kv.num_free_blocks == kv.num_blocks
    for worker in executor.workers:
        worker.strict_finished = False  # the failed steps never reached them
    after = Request("after", [3, 1, 4], SamplingParams(max_tokens=6))
    core.add_request(after)
    run(core)
    assert after.output_token_ids == expected(after, executor.token_fn)


def test_the_steps_in_flight_are_one_record_each_step_goes_on_from():
    scheduler = Scheduler(
        KVBlockManager(16, 4), 4, 16, 40, max_concurrent_batches=2, async_scheduling=True
    )
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    handle = first.scheduled_new_reqs[0].req_handle
    cached = second.scheduled_cached_reqs
    assert cached.req_handles.tolist() == [handle]
    assert cached.num_computed_tokens.tolist() == [3] and cached.num_placeholders.tolist() == [1]
    in_flight = scheduler.in_flight
    assert len(in_flight) == 2 and in_flight.steps_of(handle) == 2
    assert in_flight.num_samples[handle] == 2

    def sampled(token: int) -> ModelRunnerOutput:
        return ModelRunnerOutput(np.array([handle], np.int32), np.array([token], np.int32))

    with pytest.raises(RuntimeError, match="in the order"):
        scheduler.update_from_output(second, sampled(7))
    assert scheduler.update_from_output(first, sampled(7)) == [request]
    assert request.output_token_ids == [7] and in_flight.steps_of(handle) == 1
    third = scheduler.schedule()  # goes on from the second, whose token is still unknown
    assert third.scheduled_cached_reqs.num_computed_tokens.tolist() == [4]
    assert in_flight.num_samples[handle] == 2


def test_async_scheduling_is_refused_where_it_cannot_hold():
    kv = KVBlockManager(16, 4)
    with pytest.raises(ValueError, match="max_concurrent_batches must be 2 or more"):
        Scheduler(kv, 4, 16, 16, max_concurrent_batches=1, async_scheduling=True)
    core = make_core(pipeline_parallel_size=2)  # two stages: the batch queue's steps
    assert not core.async_scheduling and not core.scheduler.async_scheduling


class Recorded:
    """A 'graph' that replays the captured function (CUDA graph capture on the CPU)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@pytest.mark.parametrize(
    "kernels, depth", [("torch", 2), ("torch", 3), ("triton", 3)]
)  # the Triton path at depth 2 adds no case the others miss and costs half a minute
def test_the_worker_fills_placeholders_from_its_own_samples(kernels, depth):
    """The real scheduler, depth - 1 steps ahead of a real runner: each step is executed
    when it is sent, its output read only once depth steps are out. Greedy tokens equal
    transformers' on the plain-torch path and on the Triton path (the token feed, decode
    graphs)."""
    if kernels == "triton":
        pytest.importorskip("triton")
    # Two layers: the depth of the model is no part of the point, and the Triton path
    # runs every layer's kernels through the interpreter.
    path = cached_tiny_checkpoint(family="llama", num_layers=2, tie_word_embeddings=True)
    graphs = {"graph_capture": Recorded, "graph_sizes": (2, 4)} if kernels == "triton" else {}
    runner = make_runner(path, max_seqs=4, max_tokens=16, kernels=kernels, **graphs)
    scheduler = Scheduler(
        KVBlockManager(NUM_BLOCKS, runner.block_size),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=256,
        max_concurrent_batches=depth,
        async_scheduling=True,
    )
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(0, 200, n).tolist() for i, n in enumerate((5, 11, 19))}
    requests = {
        name: Request(name, prompt, SamplingParams(temperature=0.0, max_tokens=6))
        for name, prompt in prompts.items()
    }
    for request in requests.values():
        scheduler.add_request(request)
    in_flight: deque = deque()
    placeholders = 0
    for _ in range(200):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        so = scheduler.schedule() if len(in_flight) < depth else None
        if so is not None:
            placeholders += int(so.scheduled_cached_reqs.num_placeholders.sum())
            in_flight.append(
                (so, runner.execute_model(wire(RpcRequest(0, "execute_model", [so])).args[0]))
            )
            if len(in_flight) < depth:
                continue
        done, output = in_flight.popleft()
        scheduler.update_from_output(done, output.get_output())
    assert placeholders > 0
    for name, request in requests.items():
        assert request.output_token_ids == hf_greedy(path, tuple(prompts[name]), 6), name


def test_a_bad_placeholder_is_refused_with_the_request_named():
    runner = make_runner(checkpoint(), max_seqs=2, max_tokens=16, kernels="torch")
    prompt = np.arange(1, 6, dtype=np.int32)
    new = NewRequestData("a", 0, prompt, GREEDY, np.arange(2, dtype=np.int32), 5)
    runner.execute_model(SchedulerOutput([new], CachedRequestData.empty(), 5)).get_output()

    def cached(computed: int, scheduled: int, placeholders: int) -> SchedulerOutput:
        columns = CachedRequestData.build(
            [0], [computed], [scheduled], None, None, (), [placeholders]
        )
        return SchedulerOutput([], columns, scheduled)

    with pytest.raises(
        ValueError, match=r"request 'a' \(handle 0\): num_placeholders must be 0 or 1"
    ):
        runner.execute_model(cached(5, 1, 2))
    with pytest.raises(ValueError, match="its placeholder is position 4, but this worker's last"):
        runner.execute_model(cached(4, 1, 1))
    runner.execute_model(cached(5, 1, 1)).get_output()  # position 5: its sample
