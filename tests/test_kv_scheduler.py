"""The scheduler side of KV transfer, without workers: a request waiting for remote KV
holds no other back and takes its blocks only when they are free, comes in with its
remote tokens computed, and gives its blocks back only once its pull is over; it reuses
the leading blocks it finds in the prefix cache or the host tier and has only the rest
pulled, and a failed pull frees only the rest; a finished prefill's blocks are held
until its KV is reported sent."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import FakeExecutor

from messages import (
    KVConnectorOutput,
    KVFailure,
    KVTransferConfig,
    ModelRunnerOutput,
    RemoteKV,
    SamplingParams,
    SchedulerOutput,
)
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.core import EngineCore
from zmqworker.engine.host_tier import HostKVTier
from zmqworker.engine.kv_connector import KVConnectorScheduler
from zmqworker.engine.request import RemotePrefill, Request, RequestStatus
from zmqworker.engine.scheduler import Scheduler

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PARAMS_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
ADDRESS = "tcp://10.0.0.7:47000"


def scheduler(num_blocks: int, addresses: list[str]) -> Scheduler:
    kv = KVBlockManager(num_blocks, block_size=4)
    return Scheduler(kv, 8, 64, 16, kv_connector=KVConnectorScheduler(kv, addresses))


def answer(step: SchedulerOutput, report: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """Token 7 for every request of step that samples (all of them, here)."""
    handles = [r.req_handle for r in step.scheduled_new_reqs]
    handles = [*step.scheduled_cached_reqs.req_handles.tolist(), *handles]
    return ModelRunnerOutput(
        np.array(handles, np.int32), np.full(len(handles), 7, np.int32), kv_connector_output=report
    )


def remote(req_id: str, prompt: list[int], params: SamplingParams = PARAMS) -> Request:
    kv = RemoteKV(f"p-{req_id}", len(prompt), [ADDRESS], weights_version=0)
    return Request(req_id, prompt, params, remote=RemotePrefill(kv, first_token=3))


def test_a_request_waiting_for_remote_kv_holds_no_other_back() -> None:
    s = scheduler(8, [])
    waiting = remote("r", list(range(8)))
    other = Request("o", [1, 2, 3], PARAMS)
    s.add_request(waiting)
    s.add_request(other)
    step = s.schedule()
    assert [r.req_id for r in step.scheduled_new_reqs] == ["o"]
    [load] = step.kv_connector_metadata.loads
    assert load.req_id == "r" and len(load.block_ids) == 2 and load.remote.req_id == "p-r"
    assert waiting.status is RequestStatus.WAITING_FOR_REMOTE_KV
    s.update_from_output(step, answer(step))
    step = s.schedule()  # "o" decodes on; the load is not ordered twice
    assert step.kv_connector_metadata is None and len(step.scheduled_cached_reqs) == 1
    s.update_from_output(step, answer(step, KVConnectorOutput(finished_recving=["r"])))
    step = s.schedule()
    [new] = step.scheduled_new_reqs
    # Its prompt's KV came: it computes its first token (the prefill's) and samples.
    assert new.req_id == "r" and new.num_computed_tokens == 8 and new.num_scheduled_tokens == 1
    assert new.prompt_token_ids.tolist() == [*range(8), 3] and new.num_output_tokens == 1
    assert new.block_ids.tolist() == load.block_ids.tolist() + new.block_ids.tolist()[2:]
    changed = s.update_from_output(step, answer(step))
    assert waiting.output_token_ids == [3, 7] and waiting in changed


def test_a_load_goes_before_the_local_requests_that_came_after_it() -> None:
    """Blocks go first come, first served: a pull that needs more blocks than a steady
    stream of small local requests leaves free gets them before the requests that came
    after it (taken first, they left it waiting for ever)."""
    kv = KVBlockManager(8, block_size=4)
    s = Scheduler(kv, 8, 64, 32, kv_connector=KVConnectorScheduler(kv, []))
    early = [Request(f"a{i}", [1, 2, 3], PARAMS) for i in range(3)]
    for request in early:
        s.add_request(request)
    pull = remote("r", list(range(20)))  # five blocks of the five the early ones leave
    s.add_request(pull)
    later: list[str] = []
    for n in range(10):
        later.append(f"l{n}")
        s.add_request(Request(later[-1], [5, 6, 7], PARAMS))
        step = s.schedule()
        started = [r.req_id for r in step.scheduled_new_reqs]
        if step.kv_connector_metadata is not None and step.kv_connector_metadata.loads:
            break
        assert not set(started) & set(later), f"{started} started before the pull was ordered"
        s.update_from_output(step, answer(step))
    [load] = step.kv_connector_metadata.loads
    assert load.req_id == "r" and len(load.block_ids) == 5
    assert not set(started) & set(later)  # every block is taken: l0 waits behind the pull


def test_a_load_waits_for_free_blocks_and_a_failed_one_frees_them() -> None:
    s = scheduler(4, [])
    s.add_request(Request("big", list(range(13)), PARAMS))  # 4 blocks with its token
    s.add_request(remote("r", list(range(8))))
    step = s.schedule()
    assert step.kv_connector_metadata is None  # no blocks for the load yet
    s.update_from_output(step, answer(step))
    while s.running:
        step = s.schedule()
        s.update_from_output(step, answer(step))
    step = s.schedule()
    [load] = step.kv_connector_metadata.loads
    assert s.kv.num_free_blocks == 2
    failure = KVFailure("r", f"KV of request 'r': no answer from {ADDRESS}")
    changed = s.update_from_output(step, answer(step, KVConnectorOutput(failed_recving=[failure])))
    assert [(r.req_id, r.finish_reason.value, r.error) for r in changed] == [
        ("r", "abort", failure.error)
    ]
    assert s.kv.num_free_blocks == 4 and not s.has_unfinished_requests()
    # One rank (or pipeline stage) failed it; another may still be pulling into its blocks:
    # the step that may hand them out cancels it on every rank before anything of it runs.
    s.add_request(Request("next", list(range(5)), PARAMS))
    step = s.schedule()
    assert step.kv_connector_metadata.cancel_loads == ["r"]


def test_an_aborted_load_keeps_its_blocks_until_its_pull_is_over() -> None:
    s = scheduler(4, [])
    s.add_request(remote("r", list(range(8))))
    step = s.schedule()
    assert s.abort_request("r") is not None
    assert s.kv.num_free_blocks == 2  # the workers may be writing them
    s.update_from_output(step, answer(step))
    step = s.schedule()  # a step still goes: the pull's end must be heard
    s.update_from_output(step, answer(step, KVConnectorOutput(finished_recving=["r"])))
    assert s.kv.num_free_blocks == 4 and s.schedule() is None


def test_a_finished_prefill_keeps_its_blocks_until_its_kv_is_sent() -> None:
    s = scheduler(8, [ADDRESS])
    request = Request("p", list(range(10)), PARAMS, remote_decode=True)
    s.add_request(request)
    step = s.schedule()
    s.update_from_output(step, answer(step))
    assert request.is_finished and request.output_token_ids == [7]
    out = request.kv_transfer_out
    assert (out.num_tokens, out.addresses) == (10, [ADDRESS])
    assert s.kv.num_free_blocks == 5  # its 3 blocks held
    step = s.schedule()  # computes nothing: stages the KV
    [save] = step.kv_connector_metadata.saves
    # Staged under a name of its own, which the decode side pulls it by.
    assert save.req_id == out.req_id and out.req_id.startswith("p@")
    assert save.num_tokens == 10 and len(save.block_ids) == 3
    # The decode side is told where they lie, to copy them as its pull goes out.
    assert out.block_ids.tolist() == save.block_ids.tolist() == s.kv.block_ids("p")
    assert step.total_num_scheduled_tokens == 0 and step.finished_req_handles
    s.update_from_output(step, answer(step))
    assert s.kv.num_free_blocks == 5 and s.has_unfinished_requests()  # still staged
    step = s.schedule()
    s.update_from_output(step, answer(step, KVConnectorOutput(finished_sending=[out.req_id])))
    assert s.kv.num_free_blocks == 8 and s.schedule() is None


def test_no_two_stagings_share_a_name() -> None:
    """The same request id sent again, or to another instance, stages under another name:
    a decode rank that copies a staging's blocks ahead of its answer never takes one
    staging for another."""
    names = set()
    for _ in range(2):
        s = scheduler(8, [ADDRESS])
        for _ in range(2):
            request = Request("p", list(range(10)), PARAMS, remote_decode=True)
            s.add_request(request)
            step = s.schedule()
            s.update_from_output(step, answer(step))
            names.add(request.kv_transfer_out.req_id)
            step = s.schedule()  # stages it
            s.update_from_output(step, answer(step))
            report = KVConnectorOutput(finished_sending=[request.kv_transfer_out.req_id])
            step = s.schedule()
            s.update_from_output(step, answer(step, report))
            assert s.kv.num_free_blocks == 8
    assert len(names) == 4 and all(name.startswith("p@") for name in names)


def test_an_id_whose_blocks_are_held_for_a_transfer_is_refused_until_it_ends() -> None:
    """Blocks go by request id: a new request of the id of a finished prefill whose KV is
    still staged (or of an aborted pull still under way) would have its own freed with
    them."""
    s = scheduler(8, [ADDRESS])
    first = Request("p", list(range(10)), PARAMS, remote_decode=True)
    s.add_request(first)
    step = s.schedule()
    s.update_from_output(step, answer(step))
    again = Request("p", list(range(10)), PARAMS, remote_decode=True)
    with pytest.raises(ValueError, match="'p' still holds blocks here"):
        s.add_request(again)
    step = s.schedule()
    report = KVConnectorOutput(finished_sending=[first.kv_transfer_out.req_id])
    s.update_from_output(step, answer(step, report))
    s.add_request(again)  # its transfer over: the id is free
    decode = scheduler(8, [])
    decode.add_request(remote("d", list(range(8))))
    step = decode.schedule()  # orders the pull
    decode.abort_request("d")
    with pytest.raises(ValueError, match="'d' still holds blocks here"):
        decode.add_request(remote("d", list(range(8))))
    decode.update_from_output(step, answer(step))
    step = decode.schedule()
    decode.update_from_output(step, answer(step, KVConnectorOutput(finished_recving=["d"])))
    decode.add_request(remote("d", list(range(8))))


def test_after_a_failed_step_an_aborted_pull_s_blocks_go_and_its_id_is_free() -> None:
    s = scheduler(4, [])
    s.add_request(remote("r", list(range(8))))
    step = s.schedule()  # orders the pull
    s.abort_request("r")  # its blocks wait for the pull's end
    s.update_from_output(step, answer(step))
    s.reset_after_failure()  # the pull is cancelled: its end will never be heard
    assert s.kv.num_free_blocks == 4
    step = s.schedule()
    assert step.kv_connector_metadata.cancel_loads == ["r"]
    s.add_request(remote("r", list(range(8))))


def test_after_a_failed_step_the_loads_under_way_are_cancelled_before_their_blocks_serve() -> None:
    s = scheduler(4, [])
    s.add_request(remote("r", list(range(8))))
    step = s.schedule()
    assert [load.req_id for load in step.kv_connector_metadata.loads] == ["r"]
    s.reset_after_failure()  # what the engine core does when a step fails
    assert s.kv.num_free_blocks == 4  # free at once: the workers hear of it first
    s.add_request(Request("o", list(range(13)), PARAMS))  # takes every block
    step = s.schedule()
    assert step.kv_connector_metadata.cancel_loads == ["r"]
    assert [r.req_id for r in step.scheduled_new_reqs] == ["o"]
    s.update_from_output(step, answer(step))
    step = s.schedule()
    assert step.kv_connector_metadata is None  # cancelled once


def test_after_a_failed_step_staged_kv_is_withdrawn_and_its_blocks_held_until_sent() -> None:
    """A finished prefill's KV may be read in place by a puller when a step fails: its
    blocks stay held, the next step withdraws it, and they go once it is reported
    sent. A save no step carried yet was never staged: its blocks go at once."""
    s = scheduler(8, [ADDRESS])
    names = {}
    for req_id in ("staged", "unsent"):
        request = Request(req_id, list(range(8)), PARAMS, remote_decode=True)
        s.add_request(request)
        step = s.schedule()
        s.update_from_output(step, answer(step))  # finished: blocks held, save queued
        names[req_id] = request.kv_transfer_out.req_id
        if req_id == "staged":
            step = s.schedule()  # carries the save
            saves = step.kv_connector_metadata.saves
            assert [save.req_id for save in saves] == [names["staged"]]
            s.update_from_output(step, answer(step))
    assert s.kv.num_free_blocks == 4
    s.reset_after_failure()
    assert s.kv.num_free_blocks == 6  # the unsent save's blocks
    step = s.schedule()
    assert step.kv_connector_metadata.cancel_saves == [names["staged"]]
    assert step.kv_connector_metadata.saves == []
    s.update_from_output(step, answer(step))
    assert s.kv.num_free_blocks == 6 and s.has_unfinished_requests()
    step = s.schedule()
    report = KVConnectorOutput(finished_sending=[names["staged"]])
    s.update_from_output(step, answer(step, report))
    assert s.kv.num_free_blocks == 8 and s.schedule() is None


def test_after_a_worker_died_the_staged_kv_s_blocks_go_at_once() -> None:
    s = scheduler(8, [ADDRESS])
    s.add_request(Request("p", list(range(8)), PARAMS, remote_decode=True))
    for _ in range(2):  # finishes, then its save goes out
        step = s.schedule()
        s.update_from_output(step, answer(step))
    assert s.kv.num_free_blocks == 6
    s.reset_after_failure(workers_lost=True)  # nothing will report it sent
    assert s.kv.num_free_blocks == 8 and s.schedule() is None


def caching_scheduler(num_blocks: int, tier: HostKVTier | None = None) -> Scheduler:
    kv = KVBlockManager(num_blocks, block_size=4, enable_prefix_caching=True, host_tier=tier)
    return Scheduler(kv, 8, 64, 24, kv_connector=KVConnectorScheduler(kv, []))


def run_to_end(s: Scheduler, *requests: Request) -> list[list[int]]:
    """requests computed here, to their end; each one's blocks while it ran."""
    for request in requests:
        s.add_request(request)
    tables: list[list[int]] = [[] for _ in requests]
    while s.has_unfinished_requests():
        step = s.schedule()
        for i, request in enumerate(requests):
            tables[i] = s.kv.block_ids(request.req_id) or tables[i]
        s.update_from_output(step, answer(step))
    return tables


SHARED = list(range(100, 108))  # two full blocks


def test_a_remote_request_reuses_the_blocks_it_finds_cached_and_pulls_the_rest() -> None:
    s = caching_scheduler(8)
    [local] = run_to_end(s, Request("local", [*SHARED, 1, 2, 3], PARAMS))
    prompt = [*SHARED, 9, 9, 9, 9, 5]
    waiting = remote("r", prompt)
    s.add_request(waiting)
    step = s.schedule()
    [load] = step.kv_connector_metadata.loads
    assert load.num_cached_blocks == 2 and len(load.block_ids) == 4
    assert load.block_ids[:2].tolist() == local[:2]  # referenced, as any prefix hit
    assert [s.kv.ref_count(b) for b in load.block_ids] == [1, 1, 1, 1]
    # Its third block is full but its KV not here yet: no other request finds it.
    assert s.kv.get_computed_blocks("probe", [*prompt, 0])[0] == local[:2]
    s.update_from_output(step, answer(step, KVConnectorOutput(finished_recving=["r"])))
    connector = s.kv_connector
    assert (connector.num_hit_blocks, connector.num_pulled_blocks) == (2, 2)
    step = s.schedule()
    [new] = step.scheduled_new_reqs
    assert new.num_computed_tokens == len(prompt) and new.num_scheduled_tokens == 1
    s.update_from_output(step, answer(step))
    # Scheduled, it has its KV: its full blocks are the prefix cache's, from the next step.
    s.kv.new_step()
    found = s.kv.get_computed_blocks("probe2", [*prompt, 0])[0]
    assert found == load.block_ids[:3].tolist()


def test_a_failed_pull_frees_the_new_blocks_and_leaves_the_reused_ones_cached() -> None:
    s = caching_scheduler(8)
    [local] = run_to_end(s, Request("local", [*SHARED, 1, 2, 3], PARAMS))
    assert s.kv.num_free_blocks == 8
    s.add_request(remote("r", [*SHARED, 9, 9, 9, 9, 5]))
    step = s.schedule()
    [load] = step.kv_connector_metadata.loads
    assert load.num_cached_blocks == 2 and s.kv.num_free_blocks == 4
    failure = KVFailure("r", "KV of request 'r': refused")
    changed = s.update_from_output(step, answer(step, KVConnectorOutput(failed_recving=[failure])))
    assert [r.error for r in changed] == [failure.error]
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished_requests()
    assert [s.kv.ref_count(b) for b in load.block_ids] == [0, 0, 0, 0]
    assert s.kv.get_computed_blocks("probe", [*SHARED, 0])[0] == local[:2]
    assert (s.kv_connector.num_hit_blocks, s.kv_connector.num_pulled_blocks) == (0, 0)


def test_a_remote_request_reuses_a_host_tier_hit_loaded_in_the_step_that_orders_its_pull():
    tier = HostKVTier(8)
    s = caching_scheduler(6, tier)
    run_to_end(s, Request("local", [*SHARED, 1, 2, 3], PARAMS))
    # Twenty other tokens take five of the six blocks: the shared prefix's second block
    # goes to the host tier, its first stays on the device.
    run_to_end(s, Request("filler", list(range(20, 40)), PARAMS_ONE))
    assert tier.num_stored >= 1
    s.add_request(remote("r", [*SHARED, 9, 9, 9, 9, 5]))
    step = s.schedule()
    orders = step.kv_connector_metadata
    [load] = orders.loads
    assert load.num_cached_blocks == 2 and tier.num_loaded == 1
    # The same step loads the tiered block into its second block, before its forward;
    # the pull writes only the blocks after.
    assert orders.host.load_blocks.tolist() == [load.block_ids[1]]
    s.update_from_output(step, answer(step, KVConnectorOutput(finished_recving=["r"])))
    assert (s.kv_connector.num_hit_blocks, s.kv_connector.num_pulled_blocks) == (2, 2)


def test_a_request_sent_to_the_wrong_side_of_a_pair_is_refused() -> None:
    """A prefill-only engine refuses a request that brings remote KV, a decode-only one a
    request that asks for a remote decode: each before it runs, naming the side."""
    kv = KVBlockManager(8, block_size=4)
    prefill = Scheduler(kv, 8, 64, 16, kv_connector=KVConnectorScheduler(kv, [ADDRESS], False))
    with pytest.raises(ValueError, match="pulls none.*decode instance"):
        prefill.add_request(remote("r", list(range(8))))
    decode = scheduler(8, [])
    with pytest.raises(ValueError, match="serves no KV.*prefill instance"):
        decode.add_request(Request("p", [1, 2, 3], PARAMS, remote_decode=True))
    assert not prefill.has_unfinished_requests() and not decode.has_unfinished_requests()


def test_a_finished_prefill_aborted_before_its_pull_has_its_kv_withdrawn() -> None:
    """Its client gave up on it before a decode instance took its KV: a staged save is
    withdrawn by the next step and its blocks go once reported sent; a save no step
    carried yet goes at once, and is never staged. Another request's KV stays."""
    s = scheduler(12, [ADDRESS])
    names = {}
    for req_id in ("staged", "kept", "unsent"):
        request = Request(req_id, list(range(8)), PARAMS, remote_decode=True)
        s.add_request(request)
        step = s.schedule()
        s.update_from_output(step, answer(step))  # finished: blocks held, save queued
        names[req_id] = request.kv_transfer_out.req_id
        if req_id != "unsent":
            step = s.schedule()  # carries the save
            s.update_from_output(step, answer(step))
    assert s.kv.num_free_blocks == 6
    for req_id in ("staged", "unsent", "unknown"):
        s.kv_connector.withdraw(req_id)
    assert s.kv.num_free_blocks == 8  # the unsent save's blocks
    step = s.schedule()
    assert step.kv_connector_metadata.cancel_saves == [names["staged"]]
    assert step.kv_connector_metadata.saves == []
    report = KVConnectorOutput(finished_sending=[names["staged"]])
    s.update_from_output(step, answer(step, report))
    assert s.kv.num_free_blocks == 10 and s.kv_connector.holds("kept")


def test_a_decode_instance_counts_the_requests_waiting_for_their_kv_as_waiting() -> None:
    """A router balances decode instances by their load: requests waiting for blocks or
    for their pull are load (left out, a full instance reported none and took them all);
    an aborted one is not, though its pull is still under way."""
    executor = FakeExecutor(num_blocks=6, block_size=4)
    executor.world_size = 1
    core = EngineCore(executor, 24, kv_transfer=KVTransferConfig(role="consumer"))
    for i in range(3):  # two blocks each: two fit, the third waits for blocks
        core.add_request(remote(f"r{i}", list(range(8))))
    assert (core.stats().num_waiting, core.load) == (3, 3)
    core.step()  # orders the two pulls that fit
    assert core.kv_connector.num_pulls == 3 and core.stats().num_waiting == 3
    core.abort_request("r0")  # pulling: its blocks stay until the pull is reported over
    core.abort_request("r2")  # waiting for blocks
    assert (core.stats().num_waiting, core.load) == (1, 1)


def test_a_finished_prefill_names_the_weights_its_kv_came_from() -> None:
    """RemoteKV.weights_version: the prefill instance's count of weight changes when it
    computed the KV, or -1 for a request whose prompt ran across one (half each)."""
    s = scheduler(16, [ADDRESS])
    s.kv.reset_prefix_cache(new_weights=True)
    s.kv.reset_prefix_cache()  # a sleep's, or a caller's: no new weights
    whole = Request("whole", list(range(8)), PARAMS, remote_decode=True)
    s.add_request(whole)
    step = s.schedule()
    s.update_from_output(step, answer(step))
    assert whole.kv_transfer_out.weights_version == s.kv.weights_version == 1
    kv = KVBlockManager(16, block_size=4)
    chunked = Scheduler(kv, 8, 8, 16, kv_connector=KVConnectorScheduler(kv, [ADDRESS]))
    across = Request("across", list(range(12)), PARAMS, remote_decode=True)
    chunked.add_request(across)
    step = chunked.schedule()  # its prompt's first chunk: no token yet (-1)
    unsampled = ModelRunnerOutput(np.array([0], np.int32), np.array([-1], np.int32))
    chunked.update_from_output(step, unsampled)
    kv.reset_prefix_cache(new_weights=True)  # then new weights, then the rest
    step = chunked.schedule()
    chunked.update_from_output(step, answer(step))
    assert across.kv_transfer_out.weights_version == -1


def test_an_update_that_fails_part_way_is_not_counted_the_repair_is() -> None:
    """weights_version counts the weights an instance serves: one update that failed
    part-way and its repair are one change, as on a peer whose update went through (two
    counts would never meet the peer's again)."""
    from types import SimpleNamespace

    from messages import RemoteError
    from zmqworker.engine.weight_calls import PARTIAL_LOAD, WeightCalls
    from zmqworker.executor.errors import WorkerError

    fail = [True]

    def collective_rpc(method: str, args=(), kwargs=None, timeout=None) -> list:
        if fail.pop():
            error = RemoteError(0, PARTIAL_LOAD, "a disk error halfway", "")
            raise WorkerError(method, error)
        return [None]

    kv = KVBlockManager(8, block_size=4)
    executor = SimpleNamespace(collective_rpc=collective_rpc, call_timeout_s=30.0)
    weights = WeightCalls(executor, kv, lambda: None)
    with pytest.raises(RuntimeError, match="a disk error halfway"):
        weights.reload_weights("/new")
    assert weights.not_ready() is not None and kv.weights_version == 0
    fail.append(False)
    weights.reload_weights("/new")
    assert weights.not_ready() is None and kv.weights_version == 1
