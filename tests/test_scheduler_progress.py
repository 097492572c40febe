"""The scheduler always makes progress in a small cache: under pulled prompts, loaded
requests go first among the waiting ones (engine/waiting_queue.py) and give up their
blocks where nothing else would free one; with two steps in flight and chunked
prefills, two requests whose steps alternate never preempt each other for ever. With
one or two steps in flight, and with prefix caching."""

from __future__ import annotations

import numpy as np
import pytest

from messages import KVConnectorOutput, ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.test_kv_scheduler import PARAMS, remote, scheduler
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.host_tier import HostKVTier
from zmqworker.engine.kv_connector import KVConnectorScheduler
from zmqworker.engine.request import Request
from zmqworker.engine.scheduler import Scheduler
from zmqworker.engine.waiting_queue import WaitingQueue


def test_loaded_requests_holding_every_block_make_room_for_one_another() -> None:
    """Two pulled prompts fill the cache, and each needs one block more for its first
    token: with nothing running, nothing would free one. The newer, tried first, takes
    the older's blocks; the older computes its prompt itself, as a preempted request."""
    s = scheduler(4, [])
    older, newer = remote("older", list(range(8))), remote("newer", list(range(10, 18)))
    for request in (older, newer):
        s.add_request(request)
    step = s.schedule()
    assert len(step.kv_connector_metadata.loads) == 2 and s.kv.num_free_blocks == 0
    lengths: dict[int, int] = {}
    loaded = KVConnectorOutput(finished_recving=["older", "newer"])
    s.update_from_output(step, answer(step, lengths, loaded))
    step = s.schedule()
    assert [r.req_id for r in step.scheduled_new_reqs] == ["newer"]
    assert older.num_loaded_tokens == 0 and older.num_preemptions == 1 == s.num_preemptions
    s.update_from_output(step, answer(step, lengths))
    while s.has_unfinished_requests():
        step = s.schedule()
        if step is not None:
            s.update_from_output(step, answer(step, lengths))
    assert older.output_token_ids == newer.output_token_ids == [3, 7, 7, 7]
    assert s.kv.num_free_blocks == 4


def answer(
    step: SchedulerOutput, lengths: dict[int, int], report: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """Token 7 for every request of step that samples: those whose step ends their prompt
    (lengths: each handle's, from the step that started it) or decode."""
    handles, tokens = [], []
    for handle, computed, scheduled in step.scheduled_cached_reqs.columns[:3].T.tolist():
        handles.append(handle)
        tokens.append(7 if computed + scheduled >= lengths[handle] else -1)
    for new in step.scheduled_new_reqs:
        lengths[new.req_handle] = len(new.prompt_token_ids)
        handles.append(new.req_handle)
        ends = new.num_computed_tokens + new.num_scheduled_tokens >= len(new.prompt_token_ids)
        tokens.append(7 if ends else -1)
    return ModelRunnerOutput(
        np.array(handles, np.int32), np.array(tokens, np.int32), kv_connector_output=report
    )


SETTINGS = {  # (prefix caching and a host tier, steps in flight, token budget)
    "one": (False, 1, 64),
    "two": (False, 2, 64),
    "cached-two": (True, 2, 64),
    "chunked-two": (False, 2, 8),
}


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_small_cache_under_pulls_and_preemptions_always_makes_progress(
    seed: int, setting: str
) -> None:
    """Pulled and local prompts (some sharing a prefix, some sampled more than once) arrive
    at once in a cache that holds few of them, with one or two steps in flight (two: steps
    that carry only the loads' orders keep going out): loaded requests never wait behind
    a preempted one that does not fit, nor for blocks only another loaded one holds; with
    chunks of 8 tokens, a request that needs blocks waits for a newer one in a step rather
    than go itself (else two whose steps alternate preempt each other for ever); and
    every request ends."""
    caching, depth, budget = SETTINGS[setting]
    rng = np.random.default_rng(seed)
    tier = HostKVTier(6) if caching else None
    kv = KVBlockManager(12, block_size=4, enable_prefix_caching=caching, host_tier=tier)
    connector = KVConnectorScheduler(kv, [])
    s = Scheduler(kv, 8, budget, 48, max_concurrent_batches=depth, kv_connector=connector)
    shared = rng.integers(0, 100, 8).tolist()
    requests = []
    for i in range(20):
        prompt = rng.integers(0, 100, rng.integers(4, 30)).tolist()
        prompt = [*shared, *prompt[:12]] if rng.random() < 0.4 else prompt
        max_tokens = min(int(rng.integers(1, 18)), 48 - len(prompt))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        pulled = rng.random() < 0.5
        first = remote(f"r{i}", prompt, params) if pulled else Request(f"l{i}", prompt, params)
        # n > 1: the other samples share the first's prompt (engine/prompt_sharing.py)
        samples = 0 if pulled or rng.random() < 0.6 else int(rng.integers(1, 3))
        siblings = [Request(f"l{i}.{j}", prompt, params, shares_prompt_with=f"l{i}")
                    for j in range(1, samples + 1)]  # fmt: skip
        for request in (first, *siblings):
            requests.append(request)
            s.add_request(request)
    in_flight: list[tuple[SchedulerOutput, list[str]]] = []
    loading: list[str] = []  # reported with the next step to come back
    lengths: dict[int, int] = {}
    for _ in range(4000):
        if not s.has_unfinished_requests() and not in_flight:
            break
        step = s.schedule() if len(in_flight) < depth else None
        if step is not None:
            orders = step.kv_connector_metadata
            in_flight.append((step, [load.req_id for load in orders.loads] if orders else []))
        if in_flight and (step is None or len(in_flight) == depth):
            done, loads = in_flight.pop(0)
            report = KVConnectorOutput(finished_recving=loading) if loading else None
            s.update_from_output(done, answer(done, lengths, report))
            loading = loads
    assert all(r.is_finished and r.finish_reason.value == "length" for r in requests)
    assert s.kv.num_free_blocks == 12


def test_waiting_requests_go_loaded_first_then_preempted_then_new() -> None:
    """Loaded ones hold their blocks: behind a preempted request that does not fit they
    would wait for blocks only their own run frees."""
    queue, kv = WaitingQueue(), KVBlockManager(8, block_size=4)
    new, preempted, later = (Request(i, [1, 2], PARAMS) for i in ("new", "preempted", "later"))
    loaded, newer = remote("loaded", [1, 2]), remote("newer", [3, 4])
    for request in (loaded, newer):
        request.num_loaded_tokens = 2
    queue.add_new(new)
    queue.preempt(preempted, kv)
    queue.add_loaded(loaded)
    queue.preempt(later, kv)
    queue.add_loaded(newer)
    assert [r.req_id for r in queue] == ["newer", "loaded", "later", "preempted", "new"]
    assert queue.unload(newer, kv) and loaded.num_loaded_tokens == 0
    assert [r.req_id for r in queue] == ["newer", "loaded", "later", "preempted", "new"]
    assert not queue.unload(newer, kv)  # no other loaded request
