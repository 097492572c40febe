"""The host KV tier's engine side: its index (LRU, bounded, a slot never reused within the
step that reads or writes it), and the engine over fake workers whose KV cache and host
tier hold token ids (engine_helpers.FakeWorker), so that a block stored late, loaded
early or into the wrong place gives wrong tokens; and the worker's connector copying
real cache tensors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from engine_helpers import (
    FakeExecutor,
    byte_level_tokenizer,
    greedy,
    mixing_token_fn,
    reference_tokens,
    run,
)

from messages import (
    KVCacheSpec,
    KVConnectorMetadata,
    KVHostCopies,
    SchedulerConfig,
    WorkerConfig,
)
from tests.test_piece_copies import mode  # noqa: F401 (a fixture)
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.core import EngineCore
from zmqworker.engine.host_tier import HostKVTier, make_host_tier
from zmqworker.engine.request import FinishReason, Request
from zmqworker.frontend.llm import LLM
from zmqworker.kv_transfer.host_tier import HostKVConnector

H = [bytes([i]) * 32 for i in range(10)]  # block hashes
MAX_MODEL_LEN = 40


def test_the_index_drops_the_least_recently_used_and_never_grows_past_its_slots():
    tier = HostKVTier(3)
    for block in range(3):
        tier.evicted(block, H[block])
    copies = tier.take_copies()
    assert copies.store_blocks.tolist() == [0, 1, 2] and copies.store_slots.tolist() == [0, 1, 2]
    tier.new_step()
    assert tier.find([H[0], H[1]]) == [0, 1]  # H[2] is now the least recently used
    tier.new_step()
    tier.evicted(7, H[3])
    assert len(tier) == 3 and H[2] not in tier and H[3] in tier
    assert tier.take_copies().store_slots.tolist() == [2]  # H[2]'s slot
    tier.new_step()
    tier.evicted(8, H[0])  # held already: made recent, not stored twice
    assert tier.take_copies() is None and tier.num_stored == 4
    assert tier.find([H[5], H[0]]) == []  # nothing past the first miss


def test_a_slot_the_step_reads_or_writes_is_not_taken_again_in_that_step():
    tier = HostKVTier(2)
    tier.evicted(0, H[0])
    tier.new_step()
    assert tier.find([H[0]]) == [0]  # loaded this step
    tier.evicted(1, H[1])  # slot 1 is free
    tier.evicted(2, H[2])  # every slot is in use by this step: dropped
    assert tier.num_dropped == 1 and H[2] not in tier and H[0] in tier
    tier.new_step()
    tier.evicted(2, H[2])  # a new step: the least recently used slot goes
    assert H[0] not in tier and H[2] in tier
    tier.reset()
    assert len(tier) == 0 and tier.find([H[1]]) == []


def test_a_step_loads_a_slot_once():
    """Two requests of one step that miss the device where the tier holds their prefix
    (the first's loaded block is the step's own, no hit before the next step): the
    second finds the slot missing, since the worker refuses a slot loaded twice."""
    tier = HostKVTier(2)
    tier.evicted(0, H[0])
    tier.evicted(1, H[1])
    tier.take_copies()
    tier.new_step()
    tier.load(tier.find([H[0], H[1]]), [5, 6])
    assert tier.find([H[0]]) == [] and tier.find([H[1]]) == []
    assert tier.take_copies().load_slots.tolist() == [0, 1]
    tier.new_step()
    assert tier.find([H[0]]) == [0]


def test_a_tier_of_zero_is_no_tier_and_one_too_small_is_refused():
    spec = KVCacheSpec(4, 2, 8, "float32", ["a", "b"])  # 1 KiB per block over its layers
    assert make_host_tier(0, [spec]) is None
    assert make_host_tier(4 / 2**20, [spec, spec]).num_slots == 2  # 4 KiB, 2 KiB a slot
    with pytest.raises(ValueError, match="holds no block"):
        make_host_tier(1 / 2**30, [spec])
    with pytest.raises(ValueError, match=">= 0"):
        make_host_tier(-1, [spec])
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVBlockManager(8, 4, enable_prefix_caching=False, host_tier=HostKVTier(2))


def make_core(num_slots: int, num_blocks: int = 12, pp: int = 1, **kwargs) -> EngineCore:
    executor = FakeExecutor(num_blocks=num_blocks, pipeline_parallel_size=pp, defer=True)
    slot_bytes = sum(s.page_size_bytes * len(s.layer_names) for s in executor.specs)
    return EngineCore(
        executor,
        MAX_MODEL_LEN,
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        enable_prefix_caching=True,
        kv_offloading_size=num_slots * slot_bytes / 2**30,
        **kwargs,
    )


def device_hits(core: EngineCore, tokens: list[int]) -> int:
    kv = core.block_manager
    hits = kv.get_computed_blocks("probe", tokens)[1]
    kv.free("probe")  # forget the probe's hashes
    return hits


PREFIX = [(7 * i + 3) % 50 for i in range(20)]  # five blocks of 4


@pytest.mark.parametrize(("pp", "async_scheduling"), [(1, False), (1, True), (2, False)])
def test_an_evicted_prefix_comes_back_from_the_host_tier(pp, async_scheduling):
    core = make_core(num_slots=40, pp=pp, async_scheduling=async_scheduling)
    first = Request("first", [*PREFIX, 1], greedy(max_tokens=4))
    core.add_request(first)
    run(core)
    # Others fill the 12-block cache: the prefix's blocks are reused, stored first.
    for i in range(3):
        core.add_request(Request(f"other{i}", [(i + 11 * j) % 50 for j in range(30)], greedy(4)))
    run(core)
    tier = core.block_manager.host_tier
    assert device_hits(core, [*PREFIX, 2]) == 0 and tier.num_stored >= 5
    loaded = tier.num_loaded
    again = Request("again", [*PREFIX, 2], greedy(max_tokens=6))
    core.add_request(again)
    run(core)
    token_fn = core.executor.token_fn
    assert again.output_token_ids == reference_tokens([*PREFIX, 2], 6, token_fn)
    assert again.num_cached_tokens == 20 and tier.num_loaded - loaded == 5
    assert first.output_token_ids == reference_tokens([*PREFIX, 1], 4, token_fn)
    assert core.block_manager.num_free_blocks == 12


@pytest.mark.parametrize(("pp", "async_scheduling"), [(1, False), (1, True), (2, False)])
@pytest.mark.parametrize("num_slots", [3, 40])
def test_tight_caches_with_a_host_tier_give_the_reference_tokens(pp, async_scheduling, num_slots):
    """Preemption, shared prefixes, steps in flight, a tier that drops most of what it is
    given (3 slots) or keeps it all: every token is the reference's."""
    core = make_core(num_slots, pp=pp, async_scheduling=async_scheduling)
    rng = random.Random(pp + num_slots)
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (12, 17, 24)]
    requests = []
    for i in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        requests.append(Request(f"r{i}", prompt, greedy(rng.randrange(1, 10))))
        core.add_request(requests[-1])
        if i % 6 == 5:
            run(core)  # in waves: a prefix's blocks leave the device between them
    run(core)
    for request in requests:
        prompt = request.prompt_token_ids
        limit = min(request.sampling_params.max_tokens, MAX_MODEL_LEN - len(prompt))
        expected = reference_tokens(prompt, limit, core.executor.token_fn)
        assert request.output_token_ids == expected, request
        assert request.finish_reason is FinishReason.LENGTH
    tier = core.block_manager.host_tier
    assert tier.num_loaded > 0 and len(tier) <= num_slots
    assert core.block_manager.num_free_blocks == 12


def test_a_failed_step_forgets_the_host_tier():
    core = make_core(num_slots=16)
    core.block_manager.host_tier.evicted(0, H[0])
    core.block_manager.host_tier.take_copies()
    core._recover(RuntimeError("a step failed"))  # what a failed step runs
    assert len(core.block_manager.host_tier) == 0


# The worker's connector, over real cache tensors ------------------------------------


# (device, row copies): the CPU's numpy row copies, and the device path on host tensors.
PATHS = [("cpu", True), ("cpu", False)] + ([("cuda", False)] if torch.cuda.is_available() else [])


def worker_tier(device: str = "cpu", num_slots: int = 4) -> tuple[HostKVConnector, list]:
    spec = KVCacheSpec(4, 2, 8, "float32", ["a", "b"])
    caches = [torch.randn(2, 6, 2, 32, device=device) for _ in spec.layer_names]
    return HostKVConnector(num_slots, lambda: caches, spec), caches


def copies(stores=(), loads=()) -> KVConnectorMetadata:
    def column(pairs, i):
        return np.array([p[i] for p in pairs], np.int32)

    return KVConnectorMetadata(
        host=KVHostCopies(column(stores, 0), column(stores, 1), column(loads, 0), column(loads, 1))
    )


@pytest.mark.usefixtures("mode")  # the row copies in the kernel's call and in slices
@pytest.mark.parametrize(("device", "row_copies"), PATHS)
def test_the_worker_stores_before_it_loads_and_a_block_comes_back_whole(device, row_copies):
    """On CUDA the copies are queued on the stream without a wait: the zeroing between
    the steps and the reads after them are ordered by it too."""
    connector, caches = worker_tier(device)
    assert connector.buffer.is_pinned() == (device == "cuda")
    connector.row_copies = row_copies
    before = [c.clone() for c in caches]
    # Block 2 goes to slot 3 and block 5 to slot 0 (not consecutive, then a run).
    connector.before_step(copies(stores=[(2, 3), (5, 0), (1, 1)]))
    for c in caches:
        c.zero_()
    # Block 2 is stored (into slot 2) before slot 3's block lands in it, in one step.
    connector.before_step(copies(stores=[(2, 2)], loads=[(3, 2), (0, 4), (1, 0)]))
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[:, 2], before[layer][:, 2])
        assert torch.equal(cache[:, 4], before[layer][:, 5])
        assert torch.equal(cache[:, 0], before[layer][:, 1])
    assert torch.equal(connector.buffer[2], torch.zeros_like(connector.buffer[2]))
    assert connector.take_output() is None
    connector.shutdown()


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        (copies(stores=[(6, 0)]), r"block id outside \[0, 6\)"),
        (copies(loads=[(4, 0)]), r"slot id outside \[0, 4\)"),
        (copies(stores=[(1, 0), (2, 0)]), "named twice"),
        (
            KVConnectorMetadata(
                host=KVHostCopies(*[np.array(v, np.int32) for v in ([1, 2], [0], [], [])])
            ),
            "one length",
        ),
    ],
)
def test_the_worker_refuses_bad_copies_by_name(metadata, error):
    connector, _ = worker_tier()
    with pytest.raises(ValueError, match=error):
        connector.before_step(metadata)


def test_the_llm_option_reaches_the_engine_and_the_workers(tmp_path):
    """LLM(kv_offloading_size) over fake workers (its engine core in a thread): the tier's
    slots reach initialize_from_config, and prompts that share a prefix through a cache
    too small to keep it get the fake model's tokens."""
    tok = byte_level_tokenizer()
    config = {"model_type": "llama", "vocab_size": len(tok), "max_position_embeddings": 64,
              "eos_token_id": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(tmp_path)
    made: list[FakeExecutor] = []

    def factory(worker: WorkerConfig) -> FakeExecutor:
        made.append(FakeExecutor(16, worker.cache.block_size, token_fn=mixing_token_fn(50)))
        return made[-1]

    slot_bytes = 2 * 4 * 2 * 8 * 4 * 2  # FakeExecutor's two layers of 2 heads of 8
    size = 32 * slot_bytes / 2**30
    options = {"block_size": 4, "max_num_batched_tokens": 16, "enable_prefix_caching": True}
    # The second fills the 16 blocks: the first's prefix leaves the device.
    prompts = [[*PREFIX, 1], [(3 * i + 1) % 50 for i in range(56)], [*PREFIX, 3]]
    with LLM(str(tmp_path), executor=factory, kv_offloading_size=size, **options) as llm:
        outputs = [llm.generate([prompt], greedy(6))[0] for prompt in prompts]
    assert made[0].kv_cache_config.num_host_blocks == 32
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == reference_tokens(prompt, 6, mixing_token_fn(50))
    orders = [step.kv_connector_metadata for step in made[0].workers[0].steps]
    loads = [len(o.host.load_slots) for o in orders if o is not None and o.host is not None]
    assert sum(loads) == 5  # the third prompt's prefix, from the host tier
