"""The host KV tier on real workers (a tiny Llama on the CPU): a long shared prefix pushed
out of a small device cache by other requests comes back from the host tier as
prefix-cache hits, with the greedy tokens it had when it was computed; two
tensor-parallel ranks, each holding its own heads (one on CUDA, where there is one)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from messages import DeviceConfig, ParallelConfig, SamplingParams
from tests.test_kv_transfer import MAX_MODEL_LEN, worker_config
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import Request
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.frontend.llm import LLM

NUM_BLOCKS, NUM_SLOTS = 24, 40
SLOT_BYTES = 2 * (2 * 4 * 2 * 16 * 4)  # two layers of the tiny Llama's blocks (engine_helpers)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFIX = [(13 * i + 5) % 250 for i in range(40)]  # ten blocks of 4


def run(core: EngineCore, prompts: list[list[int]], name: str) -> list[Request]:
    """prompts one after the other (none preempted: its cached tokens are its first)."""
    requests = [Request(f"{name}{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
        while core.has_work():
            core.step()
    return requests


# (device, tp, async scheduling). One CPU layout only, for the time a start takes: two
# ranks, each with its own share of the tier, steps in flight; the worker's copies alone
# and one rank are in test_host_tier.py.
LAYOUTS = [("cpu", 2, True)] + ([("cuda", 1, True)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize(("device", "tp", "async_scheduling"), LAYOUTS)
def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_tokens(
    device: str, tp: int, async_scheduling: bool
) -> None:
    config = worker_config(NUM_BLOCKS // tp)  # its bytes hold NUM_BLOCKS of half the heads
    config = msgspec.structs.replace(
        config,
        parallel=ParallelConfig(tensor_parallel_size=tp),
        device=DeviceConfig(device=device, num_threads=1),
    )
    executor = MultiprocExecutor(config)
    try:
        core = EngineCore(
            executor,
            MAX_MODEL_LEN,
            config.scheduler,
            enable_prefix_caching=True,
            async_scheduling=async_scheduling,
            kv_offloading_size=NUM_SLOTS * SLOT_BYTES / 2**30,
        )
    except BaseException:
        executor.shutdown()
        raise
    try:
        kv, tier = core.block_manager, core.block_manager.host_tier
        assert kv.num_blocks == NUM_BLOCKS and tier is not None and tier.num_slots == NUM_SLOTS
        prompts = [[*PREFIX, 1, 2, 3], [*PREFIX, 7]]
        computed = run(core, prompts, "cold")  # the second hits the device cache
        assert [r.num_cached_tokens for r in computed] == [0, 40]
        # Two others of 60 tokens fill the 24 blocks: the prefix leaves the device.
        run(core, [[(i + 3 * j) % 250 for j in range(60)] for i in range(2)], "other")
        assert kv.get_computed_blocks("probe", prompts[0])[1] == 0
        kv.free("probe")
        loaded = tier.num_loaded
        again = run(core, prompts, "again")
        assert [r.output_token_ids for r in again] == [r.output_token_ids for r in computed]
        assert again[0].num_cached_tokens == 40 and tier.num_loaded - loaded == 10
        assert again[1].num_cached_tokens == 40  # from the device: the blocks just loaded
        assert len(tier) <= NUM_SLOTS and kv.num_free_blocks == NUM_BLOCKS
        stats = core.stats()
        assert (stats.num_host_blocks, stats.num_host_blocks_used) == (NUM_SLOTS, len(tier))
        assert stats.num_host_loaded_blocks == tier.num_loaded >= 10
        assert stats.num_host_stored_blocks == tier.num_stored >= 10
        assert stats.num_host_dropped_blocks == tier.num_dropped
    finally:
        core.shutdown()


def test_the_host_tier_needs_prefix_caching() -> None:
    path = worker_config(NUM_BLOCKS).model.path
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(model=path, device="cpu", kv_offloading_size=0.5)
