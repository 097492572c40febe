"""The placeholder rules of docs/protocol.md ("Placeholders (async scheduling)"), as a
worker keeps them: NUM_PLACEHOLDERS is a check the engine asks for, not an instruction
(0 and 1 compute the same token); the placeholder is the position of the worker's latest
sample for the request, however many steps ago it was made; a request can have one from
the step after the one that sampled it, its prefill included; a resumed request cannot."""

from __future__ import annotations

import numpy as np
import pytest

from messages import CachedRequestData, NewRequestData, SchedulerOutput
from tests.runner_helpers import GREEDY, checkpoint, hf_greedy, make_runner

PROMPT = np.arange(1, 6, dtype=np.int32)  # 5 tokens: positions 0..4, the first sample is 5


@pytest.fixture(scope="module")
def runner():
    return make_runner(checkpoint(), max_seqs=2, max_tokens=16, kernels="torch")


def new(handle: int, prompt: np.ndarray = PROMPT) -> SchedulerOutput:
    blocks = np.arange(4, dtype=np.int32) + 4 * handle
    req = NewRequestData(f"r{handle}", handle, prompt, GREEDY, blocks, len(prompt))
    return SchedulerOutput([req], CachedRequestData.empty(), len(prompt))


def decode(handle: int, computed: int, placeholders: int, resumed: bool = False) -> SchedulerOutput:
    cached = CachedRequestData.build(
        [handle], [computed], [1], None, None, [handle] if resumed else [], [placeholders]
    )
    return SchedulerOutput([], cached, 1)


def finish(*handles: int) -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData.empty(), 0, finished_req_handles=list(handles))


def tokens(runner, steps: list[SchedulerOutput]) -> list[int]:
    """Each step executed before the output of the one before is read (sent ahead), then
    every sampled token, in order."""
    outputs = [runner.execute_model(so) for so in steps]
    return [t for out in outputs for t in out.get_output().sampled_token_ids.tolist()]


def test_zero_and_one_compute_the_same_tokens(runner) -> None:
    """(The Triton path feeds a sample to the next step by its row and position alone,
    whatever the column says; test_async_scheduling runs it with placeholders.)"""
    ahead = tokens(runner, [new(0), decode(0, 5, 1), decode(0, 6, 1), finish(0)])
    without = tokens(runner, [new(0), decode(0, 5, 0), decode(0, 6, 0), finish(0)])
    assert ahead == without == hf_greedy(checkpoint(), tuple(PROMPT.tolist()), 3)


def test_the_placeholder_is_the_latest_sample_however_many_steps_ago(runner) -> None:
    # request 1's prefill samples position 5; a step without it; then its placeholder
    steps = [new(1), new(0), decode(1, 5, 1), decode(0, 5, 1)]
    assert len(tokens(runner, steps)) == 4
    tokens(runner, [finish(0, 1)])


def test_a_placeholder_the_worker_did_not_sample_is_refused(runner) -> None:
    runner.execute_model(new(0)).get_output()
    # position 4 is the prompt's, not a sample
    with pytest.raises(ValueError, match="its placeholder is position 4"):
        runner.execute_model(decode(0, 4, 1))
    tokens(runner, [finish(0)])


def test_a_chunk_that_samples_nothing_leaves_no_placeholder(runner) -> None:
    req = NewRequestData("r0", 0, PROMPT, GREEDY, np.arange(4, dtype=np.int32), 3)
    first_chunk = SchedulerOutput([req], CachedRequestData.empty(), 3)
    assert tokens(runner, [first_chunk]) == [-1]
    with pytest.raises(ValueError, match="this worker's last sample for it: none"):
        runner.execute_model(decode(0, 3, 1))
    tokens(runner, [finish(0)])


def test_a_resumed_request_cannot_have_a_placeholder(runner) -> None:
    runner.execute_model(new(0)).get_output()
    preempt = SchedulerOutput([], CachedRequestData.empty(), 0, preempted_req_handles=[0])
    runner.execute_model(preempt)
    cached = CachedRequestData.build([0], [5], [1], [[0, 1]], None, [0], [1])
    with pytest.raises(ValueError, match="a resumed request cannot have a placeholder"):
        runner.execute_model(SchedulerOutput([], cached, 1))
    tokens(runner, [finish(0)])
