"""Pipeline parallelism across real worker processes: the PP channel (shared memory
between these same-host stages, frames with ZMQWORKER_PP_SHM=0), the batch queue at
depth pp, split sampling (execute_model(sample=False), then sample_tokens) and a stage
dying mid-pipeline."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from messages import (
    CacheConfig,
    CachedRequestData,
    DeviceConfig,
    ModelConfig,
    NewRequestData,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from tests.test_executor import wait_gone
from tests.tiny import cached_tiny_checkpoint
from zmqworker.distributed.shm_ring import MEMFD_NAME
from zmqworker.executor.errors import WorkerError
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.frontend.errors import EngineCoreError
from zmqworker.frontend.llm import LLM

# Prompts of different lengths; a 50-token one is split into chunks by the 16-token budget.
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [1, 2, 3], list(range(10, 60)), [200, 201], [9] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def checkpoint() -> str:
    return cached_tiny_checkpoint(family="llama", num_layers=6)


DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")  # cuda: checked on the lent H200


def run(tp: int, pp: int, kv_cache_bytes: int = 1 << 20, preempts: bool = False) -> list[list[int]]:
    with LLM(
        model=checkpoint(),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        device=DEVICE,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=kv_cache_bytes,
    ) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert (llm.stats().num_preemptions > 0) == preempts
        # Every stage but the last sent its tensors through a shared-memory ring, unless
        # told not to.
        shared = os.environ.get("ZMQWORKER_PP_SHM") != "0"
        senders = llm.worker_pids[: tp * (pp - 1)]
        assert [holds_ring(pid) for pid in senders] == [shared] * len(senders)
        return tokens


def holds_ring(pid: int) -> bool:
    """Whether process pid holds a shared-memory ring segment open."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            continue
    return any(link.startswith(f"/memfd:{MEMFD_NAME}") for link in links)


@pytest.fixture(scope="module")
def single_rank() -> list[list[int]]:
    return run(1, 1)


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_stages_give_single_rank_tokens(single_rank, pp):
    assert run(1, pp) == single_rank


def test_pipeline_over_zmq_frames_gives_single_rank_tokens(single_rank, monkeypatch):
    monkeypatch.setenv("ZMQWORKER_PP_SHM", "0")  # inherited by the worker processes
    assert run(1, 2) == single_rank


def test_pipeline_with_preemption_gives_single_rank_tokens(single_rank):
    # 24 blocks of 4 tokens for 5 requests needing 37: some are preempted and recomputed,
    # through both stages. A block of one layer: K,V x 4 tokens x 2 kv heads x 16 x fp32;
    # each stage holds 3 of the 6 layers.
    block_bytes = 2 * 4 * 2 * 16 * 4 * 3
    assert run(1, 2, kv_cache_bytes=24 * block_bytes, preempts=True) == single_rank


@pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="TP=2 on CUDA needs two GPUs"
)
def test_pipeline_times_tensor_parallel_gives_single_rank_tokens(single_rank):
    assert run(2, 2) == single_rank


def test_killing_the_middle_stage_fails_the_step_and_leaves_nothing():
    llm = LLM(
        model=checkpoint(),
        pipeline_parallel_size=3,
        device=DEVICE,
        dtype="float32",
        max_num_seqs=4,
        block_size=4,
        kv_cache_bytes=1 << 20,
    )
    pids = llm.worker_pids
    middle = pids[1]

    def kill_middle() -> None:
        time.sleep(0.5)
        os.kill(middle, signal.SIGSTOP)  # frozen mid-pipeline: its step cannot finish
        os.kill(middle, signal.SIGKILL)

    killer = threading.Thread(target=kill_middle)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineCoreError, match="rank 1") as info:
            llm.generate(
                PROMPTS, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
            )
        assert time.monotonic() - start < 0.5 + 5.0
        assert info.value.exc_type in ("WorkerDiedError", "WorkerStuckError")
    finally:
        killer.join()
        llm.shutdown()
    assert wait_gone(pids, 10.0)


def test_split_sampling_at_pp2_answers_on_every_rank() -> None:
    """execute_model(sample=False), then sample_tokens, reach every rank: the first stage
    has nothing to sample and answers None to both; the last keeps the logits, then
    samples what the same step with sample=True samples."""
    config = WorkerConfig(
        model=ModelConfig(path=checkpoint(), max_model_len=64),
        parallel=ParallelConfig(pipeline_parallel_size=2),
        cache=CacheConfig(block_size=4, kv_cache_bytes=1 << 20),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        device=DeviceConfig(device=DEVICE),
    )
    prompt = np.array(PROMPTS[0], np.int32)

    def prefill(handle: int) -> SchedulerOutput:
        blocks = np.array([2 * handle, 2 * handle + 1], np.int32)
        new = NewRequestData(f"r{handle}", handle, prompt, GREEDY, blocks, len(prompt))
        return SchedulerOutput([new], CachedRequestData.empty(), len(prompt))

    with MultiprocExecutor(config) as ex:
        ex.initialize_from_config(make_kv_cache_config(ex.get_kv_cache_specs(), 16))
        # A step the first stage refuses (request 5's next token, never sent to it) fails
        # on the last at once, the refusal travelling the pipeline: the last stage would
        # wait until the step's deadline for its tensors, and the steps after it with it.
        ex.execute_model(prefill(5))
        lacking = CachedRequestData.build([5], [len(prompt)], [1])
        # Whichever rank answers first: the refusing one, or the one told.
        with pytest.raises(WorkerError, match="refused|exceeds its"):
            ex.collective_rpc("execute_model", (SchedulerOutput([], lacking, 1),), timeout=60)
        split = ex.collective_rpc("execute_model", (prefill(0),), {"sample": False}, timeout=30)
        assert split == [None, None]
        first, last = ex.collective_rpc("sample_tokens", (None,))
        assert first is None
        assert (
            last.sampled_token_ids.tolist()
            == ex.execute_model(prefill(1)).sampled_token_ids.tolist()
        )
