"""The running requests' columns: the stop screen that sends a token through Request's
rules, removal that keeps the start order, and decode steps built from arrays (block
boundaries, blocks filled by decoding found by the prefix cache, every async depth)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import FakeExecutor, reference_tokens

from messages import SamplingParams, SchedulerConfig
from zmqworker.engine.core import EngineCore
from zmqworker.engine.in_flight import StepsInFlight
from zmqworker.engine.request import Request
from zmqworker.engine.running import RunningTable


def running(table: RunningTable, req_id: str, handle: int, **params) -> Request:
    request = Request(req_id, [3, 4, 5], SamplingParams(**params), eos_token_ids=[2])
    request.handle = handle
    table.add(request, 3, max_model_len=100)
    return request


def test_the_screen_flags_stop_ids_the_length_limit_and_logprobs_and_nothing_else():
    table = RunningTable(capacity=2)
    running(table, "plain", 0, max_tokens=10)
    running(table, "many", 1, max_tokens=10, stop_token_ids=[6, 7, 8])  # three rows more
    running(table, "short", 2, max_tokens=1, ignore_eos=True)
    running(table, "logprobs", 3, max_tokens=10, logprobs=1)
    positions = np.arange(4)

    def flagged(tokens: list[int]) -> list[bool]:
        return table.may_finish(positions, np.array(tokens, np.int32)).tolist()

    assert flagged([9, 9, 9, 9]) == [False, False, True, True]
    assert flagged([2, 8, 9, 9]) == [True, True, True, True]
    assert flagged([8, 2, 2, 9]) == [False, True, True, True]  # short ignores EOS, ends anyway
    table.remove([0, 2])
    assert [r.req_id for r in table.requests] == ["many", "logprobs"]
    assert table.position_of_handle[:4].tolist() == [-1, 0, -1, 1]
    assert table.may_finish(np.arange(2), np.array([7, 9], np.int32)).tolist() == [True, True]


class CountingGrammar:
    """A matcher that takes every token and ends at token 5: the tokens it saw."""

    stop_token_ids = frozenset({5})

    def __init__(self) -> None:
        self.seen: list[int] = []

    def catch_up(self, req_id: str, token_ids: list[int]) -> None:
        self.seen = token_ids[3:]

    @property
    def terminated(self) -> bool:
        return self.seen[-1:] == [5]


def test_grammar_ends_and_remote_decodes_are_screened_and_a_remote_decode_is_not_continued():
    table = RunningTable()
    grammar = CountingGrammar()
    structured = Request("structured", [3, 4, 5], SamplingParams(max_tokens=10))
    structured.grammar = grammar  # type: ignore[assignment]
    structured.handle = 0
    table.add(structured, 3, max_model_len=100)
    remote = Request("remote", [3, 4, 5], SamplingParams(max_tokens=10), remote_decode=True)
    remote.handle = 1
    table.add(remote, 3, max_model_len=100)
    running(table, "plain", 2, max_tokens=10)
    assert table.structured[:3].tolist() == [1, 0, 0]
    # A grammar's tokens are screened where they may end it (its stop token 5).
    assert table.may_finish(np.arange(3), np.array([9, 9, 9], np.int32)).tolist() == [
        False,
        True,
        False,
    ]
    assert table.may_finish(np.arange(1), np.array([5], np.int32)).tolist() == [True]
    assert structured.append_output_token(5, 100) and grammar.seen == [5]
    # Prefilled, each with its first token in flight: a remote decode's ends it, so async
    # scheduling does not go on with it.
    in_flight = StepsInFlight()
    in_flight.reserve(2)
    in_flight.num_steps[:3] = 1
    in_flight.num_samples[:3] = 1
    core = EngineCore(FakeExecutor(num_blocks=16), 40)
    _, decodes, _, _ = table.ready(in_flight, core.block_manager, True, False)
    assert decodes.tolist() == [0, 2]


def test_decodes_are_ready_as_one_array_and_block_boundaries_go_one_by_one():
    table = RunningTable()
    for i in range(4):
        running(table, f"r{i}", i, max_tokens=10)
    table.computed[:4] = [3, 4, 7, 8]
    table.known[:4] = [4, 5, 8, 9]
    core = EngineCore(FakeExecutor(num_blocks=16), 40)
    num_left, decodes, slow, others = table.ready(StepsInFlight(), core.block_manager, False, False)
    assert decodes.tolist() == [0, 1, 2, 3] and others == []
    assert slow == [1, 3]  # block_size 4: their tokens start a block
    assert num_left.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_block_filled_by_decoding_is_found_by_a_later_request(async_scheduling):
    executor = FakeExecutor(num_blocks=32, defer=async_scheduling)
    core = EngineCore(
        executor,
        40,
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    first = Request("first", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10))
    core.add_request(first)
    while core.has_work():
        core.step()
    # The third block (block_size 4) filled while it decoded, its last token a placeholder
    # when it was computed with async scheduling.
    tokens = first.all_token_ids[:12]
    assert first.output_token_ids == reference_tokens([1, 2, 3, 4, 5, 6], 10, executor.token_fn)
    second = Request("second", [*tokens, 9], SamplingParams(max_tokens=2))
    core.add_request(second)
    while core.has_work():
        core.step()
    assert second.num_cached_tokens == 12
    assert second.output_token_ids == reference_tokens([*tokens, 9], 2, executor.token_fn)
