"""The persistent batch and step inputs against a plain-Python reference, and bad steps."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from messages import (
    CachedRequestData,
    Decoder,
    Encoder,
    NewRequestData,
    RpcRequest,
    SamplingParams,
    SchedulerOutput,
)
from zmqworker.attention.decode import AttentionGeometry
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.sampled_tokens import record_samples, token_feed, write_samples
from zmqworker.model_runner.step_inputs import StepInputBuilder

BLOCK = 4
VOCAB = 100
NUM_KV_BLOCKS = 64
MAX_SEQS = 6
MAX_LEN = 48
MAX_TOKENS = 40


def step_builder() -> StepInputBuilder:
    geometry = AttentionGeometry(4, 2, 8, torch.float32)
    return StepInputBuilder(
        MAX_TOKENS, MAX_SEQS, BLOCK, geometry, GatherWorkspace(), torch.device("cpu")
    )


def make_batch() -> InputBatch:
    batch = InputBatch(MAX_SEQS, MAX_LEN, MAX_TOKENS, BLOCK, VOCAB, 20, torch.device("cpu"))
    batch.num_kv_blocks = NUM_KV_BLOCKS
    return batch


def new_req(
    handle: int,
    prompt: list[int],
    blocks: list[int],
    scheduled: int,
    computed: int = 0,
    params: SamplingParams | None = None,
) -> NewRequestData:
    return NewRequestData(
        req_id=f"req-{handle}",
        req_handle=handle,
        prompt_token_ids=np.array(prompt, np.int32),
        sampling_params=params or SamplingParams(temperature=0.0),
        block_ids=np.array(blocks, np.int32),
        num_scheduled_tokens=scheduled,
        num_computed_tokens=computed,
    )


def step(
    new: list[NewRequestData] = (),
    cached: CachedRequestData | None = None,
    finished: list[int] = (),
    preempted: list[int] = (),
) -> SchedulerOutput:
    cached = cached or CachedRequestData.empty()
    total = sum(r.num_scheduled_tokens for r in new) + int(cached.num_scheduled_tokens.sum())
    return SchedulerOutput(list(new), cached, total, list(finished), list(preempted))


def snapshot(batch: InputBatch) -> dict:
    return {
        "arrays": [
            a.copy()
            for a in (
                batch.token_ids,
                batch.num_tokens,
                batch.block_table,
                batch.num_blocks,
                batch.handles,
                batch.temperature,
                batch.top_k,
                batch.top_p,
                batch.min_p,
                batch.num_logprobs,
                batch.seeded,
                batch.seeds,
            )
        ],
        "req_ids": list(batch.req_ids),
        "row_of": dict(batch.row_of),
        "parked": {h: p.token_ids.tolist() for h, p in batch.parked.items()},
    }


def assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["arrays"], b["arrays"], strict=True):
        np.testing.assert_array_equal(x, y)
    assert {k: v for k, v in a.items() if k != "arrays"} == {
        k: v for k, v in b.items() if k != "arrays"
    }


# a reference scheduler and batch in plain Python ----------------------------------------


@dataclass
class Ref:
    handle: int
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class Driver:
    """Random but valid steps, applied to two batches: `last` samples and appends its own
    tokens; `other` (a non-last pipeline stage) only learns them from new_token_ids."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.last, self.other = make_batch(), make_batch()
        self.free_blocks = [int(b) for b in self.rng.permutation(NUM_KV_BLOCKS)]
        self.running: dict[int, Ref] = {}
        self.parked: dict[int, Ref] = {}
        self.next_handle = 0
        self.builder = step_builder()

    def take_blocks(self, n: int) -> list[int]:
        blocks, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        assert len(blocks) == n
        return blocks

    def run_step(self) -> None:
        rng = self.rng
        finished = [h for h in self.running if rng.random() < 0.1]
        for h in finished:
            self.free_blocks += self.running.pop(h).blocks
        # only requests preempted in earlier steps resume (as vLLM's scheduler does)
        resume_now = [r for r in self.parked.values() if rng.random() < 0.5]
        preempted = [h for h in self.running if rng.random() < 0.08]
        for h in preempted:
            ref = self.parked[h] = self.running.pop(h)
            self.free_blocks += ref.blocks
            ref.blocks, ref.computed = [], 0
        budget = MAX_TOKENS
        handles, computed, scheduled, blocks, tokens, resumed = [], [], [], [], [], []
        candidates = list(self.running.values())
        for ref in candidates + resume_now:
            remaining = len(ref.tokens) - ref.computed
            if (
                budget == 0
                or rng.random() < 0.15
                or len(self.running) >= MAX_SEQS
                and ref in resume_now
            ):
                continue
            s = int(rng.integers(1, min(remaining, budget) + 1))
            need = cdiv(ref.computed + s, BLOCK) - len(ref.blocks)
            if need > len(self.free_blocks):
                continue
            if ref in resume_now:
                resumed.append(ref.handle)
                self.running[ref.handle] = self.parked.pop(ref.handle)
            new_blocks = self.take_blocks(max(need, 0))
            ref.blocks += new_blocks
            handles.append(ref.handle)
            computed.append(ref.computed)
            scheduled.append(s)
            blocks.append(new_blocks)
            tokens.append(ref.tokens[ref.computed : ref.computed + s])
            budget -= s
        new = []
        while len(self.running) < MAX_SEQS and budget > 0 and rng.random() < 0.6:
            prompt = rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
            s = int(rng.integers(1, min(len(prompt), budget) + 1))
            ref = Ref(self.next_handle, prompt, self.take_blocks(cdiv(s, BLOCK)))
            self.next_handle += 1
            self.running[ref.handle] = ref
            new.append(new_req(ref.handle, prompt, ref.blocks, s))
            budget -= s
        for_other = CachedRequestData.build(
            handles, computed, scheduled, blocks, tokens, resumed_req_handles=resumed
        )
        so = step(new, for_other, finished, preempted)
        step_last, step_other = self.last.update(so), self.other.update(so)
        order = handles + [r.req_handle for r in new]
        computed += [0] * len(new)
        scheduled += [r.num_scheduled_tokens for r in new]
        for s in (step_last, step_other):
            assert s.handles.tolist() == order
            assert s.num_computed.tolist() == computed and s.num_scheduled.tolist() == scheduled
        if order:
            self.check_inputs(step_last, self.last)
            self.check_inputs(step_other, self.other)
        sampling_rows = []
        sampled = []
        for h, c, s in zip(order, computed, scheduled, strict=True):
            ref = self.running[h]
            ref.computed = c + s
            if ref.computed == len(ref.tokens) and len(ref.tokens) < MAX_LEN:
                token = int(rng.integers(VOCAB))
                ref.tokens.append(token)
                sampling_rows.append(self.last.row_of[h])
                sampled.append(token)
            elif ref.computed == len(ref.tokens):
                self.running.pop(h)  # reached max_model_len: the engine finishes it
                self.free_blocks += ref.blocks
                self.last.remove_request(h, park=False)
                self.other.remove_request(h, park=False)
        self.last.append_sampled(np.array(sampling_rows, np.int64), np.array(sampled, np.int32))
        self.check_state()

    def check_inputs(self, scheduled, batch: InputBatch) -> None:
        inputs = self.builder.build(
            batch.token_ids,
            batch.block_table,
            scheduled.rows,
            scheduled.num_computed,
            scheduled.num_scheduled,
            scheduled.num_tokens,
        )
        ids, positions, slots = [], [], []
        for h, c, s in zip(
            scheduled.handles.tolist(),
            scheduled.num_computed.tolist(),
            scheduled.num_scheduled.tolist(),
            strict=True,
        ):
            ref = self.running[h]
            for p in range(c, c + s):
                ids.append(ref.tokens[p])
                positions.append(p)
                slots.append(ref.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        assert inputs.attn_metadata.slot_mapping.tolist() == slots
        ends = (scheduled.num_computed + scheduled.num_scheduled).tolist()
        assert inputs.seq_lens.tolist() == ends
        tables = inputs.attn_metadata.block_tables
        for i, h in enumerate(scheduled.handles.tolist()):
            used = cdiv(ends[i], BLOCK)
            assert tables[i, :used].tolist() == self.running[h].blocks[:used]

    def check_state(self) -> None:
        assert set(self.last.row_of) == set(self.running) == set(self.other.row_of)
        assert set(self.last.parked) == set(self.parked) == set(self.other.parked)
        for h, ref in self.running.items():
            assert self.last.tokens_of(h).tolist() == ref.tokens
            # the other stage may lack the latest sample until it is scheduled again
            assert self.other.tokens_of(h).tolist() in (ref.tokens, ref.tokens[:-1])
            for batch in (self.last, self.other):
                row = batch.row_of[h]
                assert batch.block_table[row, : batch.num_blocks[row]].tolist() == ref.blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_the_reference(seed: int) -> None:
    driver = Driver(seed)
    for _ in range(60):
        driver.run_step()
    assert driver.next_handle > 5  # requests joined and left along the way


# specific behaviour ---------------------------------------------------------------------


def test_step_inputs_of_a_mixed_step_with_shuffled_blocks() -> None:
    batch = make_batch()
    batch.update(
        step(
            [
                new_req(7, list(range(10, 20)), [9, 3, 40], 10),
                new_req(8, [5, 6, 7, 8, 9], [2, 17], 3),
            ]
        )
    )
    batch.append_sampled(np.array([batch.row_of[7]]), np.array([77], np.int32))
    cached = CachedRequestData.build([8, 7], [3, 10], [2, 1], [[], []])
    scheduled = batch.update(step([new_req(9, [1, 2], [5], 2)], cached))
    builder = step_builder()
    inputs = builder.build(
        batch.token_ids,
        batch.block_table,
        scheduled.rows,
        scheduled.num_computed,
        scheduled.num_scheduled,
        scheduled.num_tokens,
    )
    assert inputs.input_ids.tolist() == [8, 9, 77, 1, 2]
    assert inputs.positions.tolist() == [3, 4, 10, 0, 1]
    assert inputs.attn_metadata.slot_mapping.tolist() == [
        2 * 4 + 3,
        17 * 4 + 0,
        40 * 4 + 2,
        5 * 4 + 0,
        5 * 4 + 1,
    ]
    assert inputs.query_start_loc.tolist() == [0, 2, 3, 5]
    assert inputs.seq_lens.tolist() == [5, 11, 2]


def test_finished_request_frees_its_row_for_a_new_one() -> None:
    batch = make_batch()
    batch.update(step([new_req(h, [1, 2], [h], 2) for h in range(MAX_SEQS)]))
    assert len(batch) == MAX_SEQS
    freed = batch.row_of[3]
    batch.update(step([new_req(100, [4], [20], 1)], finished=[3, 12345]))
    assert batch.row_of[100] == freed and 3 not in batch.row_of
    assert batch.req_ids[freed] == "req-100"


def test_a_late_sample_is_not_written_over_the_next_request_of_its_row() -> None:
    """The sample of a request that finished lands after another took its row, under
    the same handle (the engine reuses dropped handles): the newcomer's prompt stays."""
    batch = make_batch()
    batch.update(step([new_req(0, [1, 2, 3], [0], 3)]))
    samples = record_samples(batch, np.array([0]), torch.tensor([99], dtype=torch.int32), None)
    batch.update(step(finished=[0]))
    batch.update(step([new_req(0, [7, 8, 9, 10, 11], [1, 2], 5)]))
    write_samples(batch, samples, wait=True)
    assert batch.tokens_of(0).tolist() == [7, 8, 9, 10, 11]
    assert token_feed(batch, samples) is None


def test_preempted_request_resumes_with_a_replaced_block_table() -> None:
    batch = make_batch()
    params = SamplingParams(temperature=0.5, seed=3)
    batch.update(step([new_req(1, [1, 2, 3, 4, 5], [10, 11], 5, params=params)]))
    batch.append_sampled(np.array([batch.row_of[1]]), np.array([42], np.int32))
    batch.update(step(preempted=[1]))
    assert 1 not in batch.row_of and batch.parked[1].token_ids.tolist() == [1, 2, 3, 4, 5, 42]
    cached = CachedRequestData.build([1], [0], [6], [[30, 31]], resumed_req_handles=[1])
    scheduled = batch.update(step(cached=cached))
    row = batch.row_of[1]
    assert scheduled.rows.tolist() == [row]
    assert batch.block_table[row, : batch.num_blocks[row]].tolist() == [30, 31]
    assert batch.tokens_of(1).tolist() == [1, 2, 3, 4, 5, 42]
    assert batch.seeds[row] == 3 and batch.temperature[row] == 0.5
    assert not batch.parked


def test_preempted_request_readded_as_new_replaces_the_kept_state() -> None:
    batch = make_batch()
    batch.update(step([new_req(1, [1, 2, 3], [10], 3)]))
    batch.update(step(preempted=[1]))
    batch.update(step([new_req(1, [1, 2, 3, 9], [12], 4)]))
    assert not batch.parked and batch.tokens_of(1).tolist() == [1, 2, 3, 9]
    # preempted and re-added in one step: nothing stays aside either
    batch.update(step([new_req(1, [1, 2, 3, 9, 8], [13, 14], 5)], preempted=[1]))
    assert not batch.parked and batch.tokens_of(1).tolist() == [1, 2, 3, 9, 8]
    assert batch.block_table[batch.row_of[1], :2].tolist() == [13, 14]


def draw_seed(batch: InputBatch, handle: int) -> int:
    """The seed of the request's next sample's draw."""
    return batch.sample_seeds(np.array([batch.row_of[handle]]))[0]


def test_a_seeded_request_draws_by_its_seed_and_sample_count_alone() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    kept = make_batch()
    kept.update(step([new_req(1, [1, 2, 3], [10], 3, params=params)]))
    first = draw_seed(kept, 1)
    kept.append_sampled(np.array([kept.row_of[1]]), np.array([42], np.int32))
    second = draw_seed(kept, 1)
    assert first != second and draw_seed(kept, 1) == second  # asking does not move it on
    # preempted, then sent again as new with its sample in its prompt: the draw it would
    # have made, whatever was drawn before
    again = make_batch()
    again.update(step([new_req(5, [9], [0], 1), new_req(1, [1, 2, 3], [10], 3, params=params)]))
    again.update(step(preempted=[1]))
    readded = new_req(1, [1, 2, 3, 42], [11], 4, params=params)
    again.update(step([msgspec.structs.replace(readded, num_output_tokens=1)]))
    assert draw_seed(again, 1) == second
    # another seed, or no seed, draws otherwise
    other = make_batch()
    other.update(step([new_req(1, [1, 2, 3], [10], 3, params=SamplingParams(seed=8))]))
    other.update(step([new_req(2, [1], [1], 1, params=SamplingParams())]))
    assert draw_seed(other, 1) != first and 1 not in other.sample_seeds(
        np.array([other.row_of[1], other.row_of[2]])
    )


def test_non_last_stage_appends_only_tokens_it_lacks() -> None:
    batch = make_batch()
    batch.update(step([new_req(1, [1, 2, 3], [10], 3)]))
    # the scheduled token (position 3) arrives from the last stage
    batch.update(step(cached=CachedRequestData.build([1], [3], [1], None, [[50]])))
    assert batch.tokens_of(1).tolist() == [1, 2, 3, 50]
    # a message that repeats known tokens appends nothing
    batch.update(step(cached=CachedRequestData.build([1], [2], [2], None, [[3, 50]])))
    assert batch.tokens_of(1).tolist() == [1, 2, 3, 50]


def test_sampling_columns_follow_the_row() -> None:
    batch = make_batch()
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, logprobs=3, seed=1)
    batch.update(step([new_req(4, [1], [0], 1, params=params)]))
    row = batch.row_of[4]
    assert (batch.temperature[row], batch.top_k[row]) == (np.float32(0.8), 5)
    assert (batch.top_p[row], batch.min_p[row]) == (np.float32(0.9), np.float32(0.1))
    assert batch.num_logprobs[row] == 3
    assert set(batch.sample_seeds(np.array([row]))) == {0}


# bad steps ------------------------------------------------------------------------------


def populated() -> InputBatch:
    batch = make_batch()
    batch.update(step([new_req(1, [1, 2, 3, 4, 5], [3, 8], 5), new_req(2, [6, 7], [1], 2)]))
    batch.append_sampled(np.array([batch.row_of[1], batch.row_of[2]]), np.array([9, 9], np.int32))
    batch.update(step(preempted=[2]))
    batch.update(step([new_req(3, [1, 1, 1], [4], 3)]))
    batch.append_sampled(np.array([batch.row_of[3]]), np.array([9], np.int32))
    return batch


BAD_STEPS = {
    "unknown handle": (
        lambda: step(cached=CachedRequestData.build([1, 77], [5, 0], [1, 1])),
        "request handle 77",
    ),
    "too many tokens": (
        lambda: step(cached=CachedRequestData.build([1], [5], [2])),
        "request 'req-1' (handle 1)",
    ),
    "computed beyond known": (
        lambda: step(cached=CachedRequestData.build([1], [7], [1], [[20]])),
        "request 'req-1' (handle 1)",
    ),
    "new prompt overscheduled": (
        lambda: step([new_req(5, [1, 2], [6], 3)]),
        "request 'req-5' (handle 5)",
    ),
    "cached block id out of range": (
        lambda: step(cached=CachedRequestData.build([3, 1], [3, 5], [1, 1], [[], [NUM_KV_BLOCKS]])),
        "request 'req-1' (handle 1): block id 64",
    ),
    "new block id out of range": (
        lambda: step([new_req(5, [1, 2], [-1], 2)]),
        "request 'req-5' (handle 5): block id -1",
    ),
    "too few blocks": (
        lambda: step([new_req(5, list(range(9)), [6, 7], 9)]),
        "request 'req-5' (handle 5)",
    ),
    "duplicate cached handle": (
        lambda: step(cached=CachedRequestData.build([1, 1], [5, 5], [1, 1])),
        "request 'req-1' (handle 1): scheduled twice",
    ),
    "new handle in use": (
        lambda: step([new_req(3, [1], [6], 1)]),
        "request 'req-3' (handle 3): handle already in use",
    ),
    "new and cached share a handle": (
        lambda: step([new_req(5, [1], [6], 1)], CachedRequestData.build([5], [0], [1])),
        "request handle 5: scheduled twice",
    ),
    "parked but not resumed": (
        lambda: step(cached=CachedRequestData.build([2], [0], [1], [[6]])),
        "request 'req-2' (handle 2): was preempted",
    ),
    "resumed but not cached": (
        lambda: step(cached=CachedRequestData.build([1], [5], [1], resumed_req_handles=[2])),
        "request 'req-2' (handle 2): resumed but not among",
    ),
    "resumed beside new requests only": (
        lambda: SchedulerOutput(
            [new_req(5, [1], [6], 1)],
            CachedRequestData.build([], [], [], resumed_req_handles=[2]),
            1,
        ),
        "request 'req-2' (handle 2): resumed but not among",
    ),
    "new block ids of no cached request": (
        lambda: SchedulerOutput(
            [new_req(5, [1], [6], 1)],
            replace(CachedRequestData.empty(), new_block_ids=np.array([6], np.int32)),
            1,
        ),
        "new_block_ids holds 1 values but NUM_NEW_BLOCKS sums to 0",
    ),
    "token id out of vocabulary": (
        lambda: step(cached=CachedRequestData.build([1], [5], [1], None, [[VOCAB]])),
        "request 'req-1' (handle 1): token id 100",
    ),
    "prompt token out of vocabulary": (
        lambda: step([new_req(5, [VOCAB + 1], [6], 1)]),
        "request 'req-5' (handle 5): prompt token ids",
    ),
    "allowed token id out of vocabulary": (
        lambda: step(
            [new_req(5, [1], [6], 1, params=SamplingParams(allowed_token_ids=[3, VOCAB]))]
        ),
        f"request 'req-5' (handle 5): allowed_token_ids holds token id {VOCAB} outside "
        f"[0, {VOCAB})",
    ),
    "preempting an unknown request": (
        lambda: step(preempted=[42]),
        "request handle 42: preempted but not in the batch",
    ),
    "more logprobs than max_logprobs": (
        lambda: step([new_req(5, [1], [6], 1, params=SamplingParams(logprobs=21))]),
        "request 'req-5' (handle 5): logprobs 21 > max_logprobs 20",
    ),
    "batch full": (
        lambda: step([new_req(10 + i, [1], [10 + i], 1) for i in range(MAX_SEQS + 1)]),
        "max_num_seqs",
    ),
    "float prompt": (
        lambda: step([replace(new_req(5, [1], [6], 1), prompt_token_ids=np.array([1.0]))]),
        "request 'req-5' (handle 5): prompt_token_ids must hold integers, got float64",
    ),
    "2-D prompt": (
        lambda: step([replace(new_req(5, [1], [6], 1), prompt_token_ids=np.array([[1]]))]),
        "request 'req-5' (handle 5): prompt_token_ids must have 1 dimension(s), got shape [1, 1]",
    ),
    "bool block ids": (
        lambda: step([replace(new_req(5, [1], [6], 1), block_ids=np.array([True]))]),
        "request 'req-5' (handle 5): block_ids must hold integers, got bool",
    ),
    "float columns": (
        lambda: step(cached=CachedRequestData(np.ones((6, 1)))),
        "CachedRequestData.columns must hold integers, got float64",
    ),
    "five columns": (
        lambda: step(cached=CachedRequestData(np.zeros((5, 1), np.int32))),
        "CachedRequestData.columns must be int32 [6, n], got shape [5, 1]",
    ),
    "2-D new block ids": (
        lambda: step(
            cached=replace(
                CachedRequestData.build([1], [5], [1], [[6]]), new_block_ids=np.array([[6]])
            )
        ),
        "new_block_ids must have 1 dimension(s), got shape [1, 1]",
    ),
    "new token id past int32": (
        lambda: step(
            cached=replace(
                CachedRequestData.build([1], [5], [1], None, [[9]]),
                new_token_ids=np.array([2**32 + 9]),
            )
        ),
        "new_token_ids: 4294967305 does not fit in int32",
    ),
    "wrong total": (
        lambda: SchedulerOutput([], CachedRequestData.build([1], [5], [1]), 3),
        "total_num_scheduled_tokens",
    ),
}


def replace(struct, **fields):
    return msgspec.structs.replace(struct, **fields)


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_bad_step_is_rejected_and_changes_nothing(case: str) -> None:
    batch = populated()
    make_step, message = BAD_STEPS[case]
    bad = make_step()
    # where the case allows, the bad step also finishes and preempts requests: neither
    # may happen
    cached = bad.scheduled_cached_reqs
    mentioned = {r.req_handle for r in bad.scheduled_new_reqs}
    mentioned |= set(cached.req_handles.tolist()) | set(cached.resumed_req_handles)
    if 3 not in mentioned and not bad.finished_req_handles:
        bad.finished_req_handles = [3]
    if 1 not in mentioned and not bad.preempted_req_handles:
        bad.preempted_req_handles = [1]
    before = snapshot(batch)
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.update(bad)
    assert_same(before, snapshot(batch))
    # and the batch still takes a good step afterwards
    scheduled = batch.update(
        step(cached=CachedRequestData.build([1, 3], [5, 3], [1, 1], [[], [6]]))
    )
    assert scheduled.num_tokens == 2


def every_int32_field_as(dtype: str) -> SchedulerOutput:
    """A step of populated() that fills every int32 array field of a step, each in dtype,
    as an engine that writes that dtype sends it (through the codec)."""
    cached = CachedRequestData.build(
        req_handles=[1, 3],
        num_computed_tokens=[5, 3],
        num_scheduled_tokens=[1, 2],
        new_block_ids=[[6], [7]],
        new_token_ids=[[], [9, 42]],
    )
    arrays = dict(
        columns=cached.columns,
        new_block_ids=cached.new_block_ids,
        new_token_ids=cached.new_token_ids,
    )
    cached = replace(cached, **{k: v.astype(dtype) for k, v in arrays.items()})
    new = new_req(5, [1, 2], [11], 2)
    new = replace(new, prompt_token_ids=np.array([1, 2], dtype), block_ids=np.array([11], dtype))
    so = step([new], cached)
    return Decoder().decode(Encoder().encode(RpcRequest(0, "execute_model", [so]))).args[0]


@pytest.mark.parametrize("dtype", ["int64", "int16", "uint8"])
def test_every_int32_field_takes_any_integer_dtype_and_converts_it(dtype: str) -> None:
    expected, batch = populated(), populated()
    expected.update(every_int32_field_as("int32"))
    wide = every_int32_field_as(dtype)
    assert wide.scheduled_cached_reqs.columns.dtype == np.dtype(dtype)
    scheduled = batch.update(wide)
    assert_same(snapshot(expected), snapshot(batch))
    assert batch.tokens_of(3).tolist() == [1, 1, 1, 9, 42]
    assert scheduled.handles.dtype == np.int32 and scheduled.handles.tolist() == [1, 3, 5]
