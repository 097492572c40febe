"""Data-parallel replicas: D engine cores, each with its own workers, behind one client.
The same greedy tokens as one engine, requests spread over the replicas, an abort that
frees the blocks of the replica that ran it, a killed replica that fails only its own
requests; and a layout that does not fit the visible GPUs refused before anything
starts, device and dtype "auto" resolved without torch."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import msgspec
import psutil
import pytest
import torch

from messages import ParallelConfig, SamplingParams, WorkerConfig
from messages.config import ModelConfig
from tests.test_engine_e2e import PROMPTS, checkpoint_with_tokenizer, hf_greedy, make_llm
from tests.test_executor import wait_gone
from zmqworker.frontend import devices
from zmqworker.frontend.errors import EngineCoreDiedError, EngineCoreError
from zmqworker.frontend.llm import LLM
from zmqworker.transport.spawn_env import SHARE_GPUS_ENV

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def dp2():
    with make_llm(data_parallel_size=2) as llm:
        yield llm


async def streams(llm: LLM, prompts, params) -> tuple[list, set[int]]:
    """Every prompt as a stream at once: the last outputs (or the errors), and the
    replicas that ran them."""
    replicas: set[int] = set()

    async def one(prompt):
        last = None
        async for out in llm.generate_stream(prompt, params):
            if last is None:
                replicas.add(llm.client.engine_of(out.request_id))
            last = out
        return last

    results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
    return list(results), replicas


def test_replicas_give_one_engine_s_tokens_and_share_the_requests(dp2):
    assert len(dp2.engine_core_pids) == 2 and len(dp2.worker_pids) == 2
    outs = dp2.generate(PROMPTS, GREEDY)
    expected = [hf_greedy(tuple(p), 10) for p in PROMPTS]
    assert [o.token_ids for o in outs] == expected
    results, replicas = asyncio.run(streams(dp2, PROMPTS, GREEDY))
    assert [r.token_ids for r in results] == expected
    assert replicas == {0, 1}  # least loaded: both took requests
    assert dp2.collective_rpc("check_health") == [None, None]  # a worker of each


def test_an_abort_frees_the_blocks_of_the_replica_that_ran_it(dp2):
    before = dp2.stats()
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def closed_early() -> int | None:
        stream = dp2.generate_stream(PROMPTS[2], long)
        async with contextlib.aclosing(stream):
            async for out in stream:
                return dp2.client.engine_of(out.request_id)
        return None

    replica = asyncio.run(closed_early())
    assert replica in (0, 1)
    after = dp2.stats()
    for engine in after.per_engine:
        assert engine.num_running == 0 and engine.num_free_blocks == engine.num_blocks
    aborted = [
        a.num_aborted - b.num_aborted
        for a, b in zip(after.per_engine, before.per_engine, strict=True)
    ]
    assert aborted == [1 if i == replica else 0 for i in range(2)]


def test_prompts_that_share_a_prefix_go_to_the_replica_that_computed_it():
    """With prefix caching, prompts that share a prefix go where it was computed (their
    loads within prefix_affinity.SLACK), all at once as well: that replica computes
    their tails only, the other none of them."""
    prefix = list(range(260, 300))  # ten blocks of 4
    prompts = [prefix + [k, k + 1] for k in range(2, 10, 2)]
    with make_llm(data_parallel_size=2, enable_prefix_caching=True) as llm:
        assert all(e.ready.prefix_caching for e in llm.client.engines)
        first = llm.generate([[*prefix, 1]], GREEDY)
        outs = llm.generate(prompts, GREEDY)
        after = [e.num_prefill_tokens for e in llm.stats().per_engine]
    assert first[0].token_ids == hf_greedy((*prefix, 1), 10)
    assert [o.num_cached_tokens for o in first + outs] == [0] + [len(prefix)] * len(prompts)
    assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 10) for p in prompts]
    assert sorted(after) == [0, len(prefix) + 1 + 2 * len(prompts)]


def test_a_killed_replica_fails_its_own_requests_and_the_other_serves_on():
    llm = make_llm(data_parallel_size=2)
    cores, workers = llm.engine_core_pids, llm.worker_pids
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def scenario():
        running = asyncio.create_task(streams(llm, PROMPTS, long))
        while not llm.client.engines[1].requests:
            await asyncio.sleep(0.01)
        os.kill(cores[1], signal.SIGKILL)
        return await running

    try:
        results, _ = asyncio.run(scenario())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, EngineCoreDiedError) for r in failed)
        assert all("engine core 1" in str(r) for r in failed)
        for prompt, result in zip(PROMPTS, results, strict=True):
            if not isinstance(result, BaseException):
                assert result.token_ids == hf_greedy(tuple(prompt), 40)
        assert wait_gone([workers[1]], 10.0), "the killed replica's worker outlived it"
        [out] = llm.generate([PROMPTS[0]], GREEDY)  # on the replica left
        assert out.token_ids == hf_greedy(tuple(PROMPTS[0]), 10)
    finally:
        llm.shutdown()
    assert wait_gone([*cores, *workers], 10.0)


def test_a_replica_whose_worker_dies_between_steps_takes_no_more_requests():
    """Idle, a replica learns of its worker's death from its executor, not from the next
    step: it tells its clients and stops, and the next requests go to the other."""
    llm = make_llm(data_parallel_size=2)
    cores, workers = llm.engine_core_pids, llm.worker_pids
    try:
        os.kill(workers[1], signal.SIGKILL)
        assert wait_gone([cores[1]], 10.0), "an idle replica outlived its worker"
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 10) for p in PROMPTS]
        with pytest.raises(EngineCoreError, match="engine core 1: WorkerDiedError: worker rank 0"):
            llm.stats()
    finally:
        llm.shutdown()
    assert wait_gone([*cores, *workers], 10.0)


@pytest.mark.skipif(
    os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu") != "cuda" or torch.cuda.device_count() < 2,
    reason="two GPUs (ZMQWORKER_TEST_DEVICE=cuda)",
)
def test_each_replica_takes_a_gpu_of_its_own():
    free = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    with make_llm(data_parallel_size=2, device="cuda") as llm:
        used = [free[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
        assert all(u > 64 << 20 for u in used), used  # a worker (its context) on each
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 10) for p in PROMPTS]


def test_more_ranks_than_visible_gpus_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr("zmqworker.frontend.engine_plan.visible_gpu_count", lambda: 2)
    monkeypatch.delenv(SHARE_GPUS_ENV, raising=False)
    children = psutil.Process().children(recursive=True)
    refused = r"data_parallel_size=2 x tensor_parallel_size=2 .* is 4 ranks, but 2 GPU"
    with pytest.raises(ValueError, match=refused):
        LLM(
            checkpoint_with_tokenizer(), device="cuda", data_parallel_size=2, tensor_parallel_size=2
        )
    assert psutil.Process().children(recursive=True) == children  # nothing started
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    devices.check_gpu_layout(2, 2, 1, 2)  # allowed: ranks share the GPUs (tests)


def test_a_worker_s_local_rank_follows_its_replica():
    from zmqworker.worker.torch_worker import Worker

    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1)
    config = WorkerConfig(model=ModelConfig(path="unused"), parallel=parallel)
    assert [Worker(config, rank).local_rank for rank in range(2)] == [2, 3]
    # Another instance's ranks first on the host (a disaggregated pair's prefill's).
    after = msgspec.structs.replace(parallel, first_local_rank=4)
    config = WorkerConfig(model=ModelConfig(path="unused"), parallel=after)
    assert [Worker(config, rank).local_rank for rank in range(2)] == [6, 7]
    for field in ("first_local_rank", "host_ranks"):
        bad = msgspec.structs.replace(parallel, **{field: -1})
        with pytest.raises(ValueError, match=f"{field}=-1"):
            Worker(WorkerConfig(model=ModelConfig(path="unused"), parallel=bad), 0)


@pytest.mark.parametrize(
    ("nodes", "listed", "count"),
    [(2, None, 2), (2, "1", 1), (2, "0,1,2", 2), (4, "3,-1,0", 1), (2, "", 0), (0, "0", 0)],
)
def test_visible_gpus_are_counted_without_torch(monkeypatch, nodes, listed, count):
    names = [f"nvidia{i}" for i in range(nodes)] + ["nvidiactl", "null"]
    monkeypatch.setattr(devices.os, "listdir", lambda path: names)
    if listed is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert devices.visible_gpu_count() == count


def test_auto_device_and_dtype():
    assert devices.resolve_device("auto", 0) == ("cpu", "auto: no GPU visible")
    assert devices.resolve_device("auto", 2)[0] == "cuda"
    assert devices.resolve_device("cpu", 2) == ("cpu", "asked")
    assert devices.resolve_dtype("auto", "cpu", "bfloat16")[0] == "float32"
    assert devices.resolve_dtype("auto", "cuda", "float32")[0] == "bfloat16"
    assert devices.resolve_dtype("auto", "cuda", "float16")[0] == "float16"
    assert devices.resolve_dtype("auto", "cuda", None)[0] == "bfloat16"
    assert devices.resolve_dtype("float16", "cpu", "bfloat16") == ("float16", "asked")
