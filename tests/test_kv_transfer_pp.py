"""KV transfer between instances of two pipeline stages each: each decode stage pulls
its layers from the prefill stage of its number, every stage reports its own transfers,
and the engine's executor hands a transfer to the scheduler once every stage has
reported it (executor/stage_reports.py). Greedy tokens equal the decode instance's own
(colocated) ones, no block is left held on either side, and a pull that fails on the
stages, or on one of them, fails its request alone, with the stage named. Between
instances of other stage counts (and tensor parallel sizes), each decode rank pulls its
layers from every prefill stage holding some of them, with the same tokens."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from messages import KVTransferConfig, ParallelConfig
from messages.kv_transfer import RemoteKV
from tests.test_kv_transfer import (
    DEVICE,
    GREEDY,
    KEYS,
    MAX_MODEL_LEN,
    PROMPTS,
    free_port,
    run_colocated,
    worker_config,
)
from zmqworker.engine.core import EngineCore
from zmqworker.engine.disaggregated import DisaggregatedEngine, start_disaggregated
from zmqworker.engine.request import RemotePrefill, Request
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.frontend.disaggregated_plan import free_ports
from zmqworker.transport.curve import KV_CURVE_ENV

STAGES = 2
# The flat instance's tensor parallel size: 2, but for one GPU (an NCCL group takes one
# rank a GPU), where the stage counts still differ.
FLAT_TP = 1 if DEVICE == "cuda" and torch.cuda.device_count() < 2 else 2


@pytest.fixture(scope="module")
def pair() -> Iterator[DisaggregatedEngine]:
    """Prefill in chunks of 16 tokens (a request's KV staged over several steps), on two
    stages; the decode side on two stages, with prefix caching."""
    config = worker_config(48)
    config = msgspec.structs.replace(config, parallel=ParallelConfig(pipeline_parallel_size=STAGES))
    engine = start_disaggregated(
        config,
        MAX_MODEL_LEN,
        free_ports(STAGES),  # rank r of the prefill instance serves on port + r
        prefill_scheduler=msgspec.structs.replace(config.scheduler, max_num_batched_tokens=16),
        enable_prefix_caching=True,
        timeout_s=3.0,
        keys=KEYS,
    )
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def flat() -> Iterator[EngineCore]:
    """One pipeline stage of tensor parallel size FLAT_TP, producer and consumer both: a
    decode instance for the pair's prefill (two stages of size 1), and a prefill
    instance for its decode."""
    config = worker_config(48)
    transfer = KVTransferConfig(role="both", port=free_ports(FLAT_TP), timeout_s=3.0)
    parallel = ParallelConfig(tensor_parallel_size=FLAT_TP)
    instance = msgspec.structs.replace(config, kv_transfer=transfer, parallel=parallel)
    executor = MultiprocExecutor(instance, env={KV_CURVE_ENV: KEYS.to_env()})
    try:
        core = EngineCore(executor, MAX_MODEL_LEN, instance.scheduler,
                          enable_prefix_caching=True, kv_transfer=transfer)  # fmt: skip
    except BaseException:
        executor.shutdown()
        raise
    try:
        yield core
    finally:
        core.shutdown()


def all_free(pair: DisaggregatedEngine) -> bool:
    return all(
        core.block_manager.num_free_blocks == core.block_manager.num_blocks
        for core in (pair.prefill, pair.decode)
    )


def test_greedy_tokens_equal_colocated_over_pipeline_stages(pair: DisaggregatedEngine) -> None:
    colocated = run_colocated(pair.decode)
    pair.decode.reset_prefix_cache()
    results = pair.generate(PROMPTS, GREEDY, timeout_s=300)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == colocated
    assert pair.decode.kv_connector.num_loaded == len(PROMPTS)  # pulled, none recomputed
    while pair.has_work():
        pair.step()
    assert all_free(pair)
    # Again: the decode side finds the prefixes in its cache and pulls only the rest.
    hits = pair.decode.kv_connector.num_hit_blocks
    again = pair.generate(PROMPTS, GREEDY, timeout_s=300)
    assert [r.token_ids for r in again] == colocated
    assert pair.decode.kv_connector.num_hit_blocks > hits


def test_a_pull_that_fails_on_the_stages_fails_its_request_alone(
    pair: DisaggregatedEngine,
) -> None:
    """Nobody answers either stage's pull: the request fails with the stage and the
    address named, once (not once a stage), and a request decoding beside it goes on."""
    decode = pair.decode
    beside = Request("beside", PROMPTS[0], GREEDY)
    decode.add_request(beside)
    decode.step()
    dead = [f"tcp://127.0.0.1:{free_port()}" for _ in range(STAGES)]
    remote = RemotePrefill(RemoteKV("gone", 9, dead, pipeline_stages=STAGES), first_token=3)
    orphan = Request("orphan", [1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY, remote=remote)
    decode.add_request(orphan)
    while decode.has_work():
        decode.step()
    assert orphan.is_finished and orphan.finish_reason.value == "abort"
    assert orphan.error is not None and "pipeline stage" in orphan.error
    assert any(address in orphan.error for address in dead)
    assert beside.error is None and len(beside.output_token_ids) == GREEDY.max_tokens
    assert all_free(pair)


def test_a_pull_that_fails_on_one_stage_alone_fails_its_request_and_frees_both_sides(
    pair: DisaggregatedEngine, capfd: pytest.CaptureFixture[str]
) -> None:
    """Decode stage 0 pulls its layers from the prefill; stage 1 is sent to an address
    nobody answers. The request fails naming stage 1 as soon as that stage does (its
    blocks freed, the pull cancelled on every stage by the next step), and the prefill's
    stage 1 lets its staged KV go at the timeout."""
    prefill, decode = pair.prefill, pair.decode
    request = Request("half", PROMPTS[2], GREEDY, remote_decode=True)
    prefill.add_request(request)
    while request.kv_transfer_out is None:
        prefill.step()
    staged = request.kv_transfer_out
    dead = f"tcp://127.0.0.1:{free_port()}"
    remote = msgspec.structs.replace(staged, addresses=[staged.addresses[0], dead])
    on_decode = Request("half", PROMPTS[2], GREEDY, remote=RemotePrefill(remote, 3))
    decode.add_request(on_decode)
    while decode.has_work() or prefill.has_work():  # both go on, as deployed
        for core in (decode, prefill):  # (the prefill's next step stages the KV)
            if core.has_work():
                core.step()
    assert on_decode.finish_reason is not None and on_decode.finish_reason.value == "abort"
    assert "pipeline stage 1" in (on_decode.error or "") and dead in on_decode.error
    assert "rank 0: staged KV" not in capfd.readouterr().err  # stage 0 was pulled
    assert all_free(pair)
    [later] = pair.generate([PROMPTS[2]], GREEDY, timeout_s=300)
    assert later.error is None and later.token_ids == run_colocated(decode, prompts=[PROMPTS[2]])[0]


@pytest.mark.parametrize("way", ["two stages into one", "one stage into two"])
def test_greedy_tokens_equal_colocated_between_other_stage_counts(
    pair: DisaggregatedEngine, flat: EngineCore, way: str
) -> None:
    """The pair's prefill (two stages of tp 1) into the flat instance (one stage of tp FLAT_TP),
    and the flat instance into the pair's decode: each decode rank takes its heads of
    its layers from every prefill rank holding some, and the tokens are the decode
    instance's own; every block goes back on both sides."""
    prefill, decode = (pair.prefill, flat) if way == "two stages into one" else (flat, pair.decode)
    colocated = run_colocated(decode)
    decode.reset_prefix_cache()
    routed = DisaggregatedEngine(prefill, decode)
    loaded = decode.kv_connector.num_loaded
    results = routed.generate(PROMPTS, GREEDY, timeout_s=300)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == colocated
    assert decode.kv_connector.num_loaded == loaded + len(PROMPTS)  # pulled, none recomputed
    while routed.has_work():
        routed.step()
    assert all_free(routed)


def test_a_prefill_of_stages_the_model_cannot_have_is_refused_by_name(
    pair: DisaggregatedEngine,
) -> None:
    """A RemoteKV of three prefill stages for a model of two layers cannot say where any
    layer is: its KV is refused (the request fails, naming both layouts), not copied
    into the wrong layers."""
    decode = pair.decode
    three = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    remote = RemotePrefill(RemoteKV("flat", 9, three, pipeline_stages=3), first_token=3)
    request = Request("flat", [1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY, remote=remote)
    decode.add_request(request)
    while decode.has_work():
        decode.step()
    assert request.finish_reason is not None and request.finish_reason.value == "abort"
    error = request.error or ""
    assert "3 pipeline stage(s), this decode instance 1 and 2" in error
    assert "exceeds the model's 2 layers" in error
    assert all_free(pair)
    [later] = pair.generate([PROMPTS[1]], GREEDY, timeout_s=300)
    assert later.error is None and len(later.token_ids) == GREEDY.max_tokens
