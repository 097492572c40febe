"""The KV cache while requests are unfinished: a new cache (initialize_from_config, even
of the same size) or a warm-up (whose dummy steps write blocks 0.. of the real cache)
would change what their next steps read, silently; both are refused naming a request,
in a row or preempted and kept aside. A sleeping worker has no cache: wake_up allocates
it again, the loss of its KV documented."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from messages import CachedRequestData, NewRequestData, SchedulerOutput, make_kv_cache_config
from tests.runner_helpers import GREEDY, NUM_BLOCKS, checkpoint, hf_greedy, make_runner
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.model_runner import ModelRunner

PROMPT = (5, 17, 3, 42, 8, 11, 23)
REFUSAL = "while 1 request\\(s\\) are unfinished, request 'x' \\(handle 3\\) among them"


def token(out: object) -> int:
    assert isinstance(out, AsyncModelRunnerOutput)
    (sampled,) = out.get_output().sampled_token_ids.tolist()
    return sampled


def start(runner: ModelRunner) -> int:
    blocks = np.array([0, 1, 2, 3], np.int32)
    new = NewRequestData("x", 3, np.array(PROMPT, np.int32), GREEDY, blocks, len(PROMPT))
    return token(runner.execute_model(SchedulerOutput([new], CachedRequestData.empty(), 7)))


def decode(runner: ModelRunner, computed: int) -> int:
    cached = CachedRequestData.build([3], [computed], [1])
    return token(runner.execute_model(SchedulerOutput([], cached, 1)))


def new_cache(num_blocks: int) -> Callable[[ModelRunner], None]:
    def call(runner: ModelRunner) -> None:
        runner.initialize_kv_cache(make_kv_cache_config([runner.get_kv_cache_spec()], num_blocks))

    return call


CALLS = {
    "initialize_from_config": new_cache(NUM_BLOCKS),
    "initialize_from_config larger": new_cache(NUM_BLOCKS + 8),
    "compile_or_warm_up_model": lambda runner: runner.warm_up([1]),
}


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint()


@pytest.mark.parametrize("what", CALLS)
def test_refused_while_a_request_reads_the_cache_and_its_tokens_stay_right(path, what) -> None:
    runner = make_runner(path)
    tokens = [start(runner)]
    cache = runner.kv_caches
    with pytest.raises(RuntimeError, match=f"{what.split()[0]} {REFUSAL}"):
        CALLS[what](runner)
    assert runner.kv_caches is cache
    tokens += [decode(runner, len(PROMPT) + i) for i in range(4)]
    assert tokens == hf_greedy(path, PROMPT, 5)


def test_a_preempted_request_kept_aside_counts_until_it_finishes(path) -> None:
    runner = make_runner(path)
    start(runner)
    runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [], [3]))
    assert len(runner.batch) == 0 and 3 in runner.batch.parked
    for call in CALLS.values():
        with pytest.raises(RuntimeError, match=REFUSAL):
            call(runner)
    runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [3]))
    for call in CALLS.values():
        call(runner)
    assert start(runner) == hf_greedy(path, PROMPT, 1)[0]


def test_asleep_the_cache_comes_back_for_the_requests_that_fit_it(path) -> None:
    """Sleep released the cache, its KV with it: wake_up's new cache is allowed, unless a
    request's blocks reach past it."""
    runner = make_runner(path)
    start(runner)
    runner.release_kv_cache()  # what sleep does
    with pytest.raises(ValueError, match="'x' \\(handle 3\\) holds block 3, past the 2 blocks"):
        new_cache(2)(runner)
    assert runner.kv_caches == []
    new_cache(NUM_BLOCKS)(runner)
    assert len(runner.kv_caches) > 0 and len(runner.batch) == 1


def test_a_request_whose_kv_sleep_released_is_preempted_or_finished_not_decoded(path) -> None:
    """Its next decode would read the new cache's zeros as its history: refused by name;
    preempted, it comes back recomputed with transformers' tokens."""
    runner = make_runner(path)
    first = start(runner)
    runner.release_kv_cache()  # what sleep does
    new_cache(NUM_BLOCKS)(runner)  # what wake_up does
    with pytest.raises(ValueError, match="'x' \\(handle 3\\): its KV went with the cache a sl"):
        decode(runner, len(PROMPT))
    runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [], [3]))
    known = len(PROMPT) + 1
    resumed = CachedRequestData.build([3], [0], [known], [[4, 5, 6]], resumed_req_handles=[3])
    tokens = [first, token(runner.execute_model(SchedulerOutput([], resumed, known)))]
    tokens += [decode(runner, known + i) for i in range(2)]
    assert tokens == hf_greedy(path, PROMPT, 4)
    assert not runner.batch.kv_dropped
