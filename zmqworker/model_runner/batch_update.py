"""Planning a SchedulerOutput's changes to the persistent batch: a pure check.

plan_update checks the whole step against a read-only view of the batch (BatchView)
without touching it; the batch then makes the planned changes (InputBatch.apply). A
rejected step therefore leaves the batch exactly as it was. The order of a step: finished
and preempted requests leave, preempted ones are kept aside, then cached requests take
their deltas and new requests join.

A request can compute at most the tokens it has (prompt and outputs): after its new
tokens are appended, num_computed + num_scheduled <= its token count. new_token_ids of a
request are its tokens at positions [num_computed, num_computed + count): only those
beyond what the batch holds are appended, so the last pipeline stage, which appended its
own samples, and the other stages can be sent the same message. A placeholder (async
scheduling) is a scheduled last token the engine has not seen: it must be the very
position this worker sampled last for the request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from messages import NewRequestData, SamplingParams, SchedulerOutput
from messages.step import (
    HANDLE,
    NUM_COLUMNS,
    NUM_COMPUTED,
    NUM_NEW_BLOCKS,
    NUM_NEW_TOKENS,
    NUM_PLACEHOLDERS,
    NUM_SCHEDULED,
)
from zmqworker.model_runner.int32_arrays import int32_array
from zmqworker.model_runner.placeholders import check_placeholders

_MAX_HANDLE = 2**31 - 1


class _Parked(Protocol):
    token_ids: np.ndarray


class BatchView(Protocol):
    """What planning reads of the batch (input_batch.InputBatch), and never writes."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_blocks_per_req: int
    block_size: int
    vocab_size: int
    max_logprobs: int
    num_kv_blocks: int
    num_tokens: np.ndarray
    last_sampled: np.ndarray  # per row: the position of its latest sample here, or -1
    num_blocks: np.ndarray
    row_of: Mapping[int, int]
    parked: Mapping[int, _Parked]
    kv_dropped: Set[int]  # handles in rows whose KV a released cache took

    def __len__(self) -> int: ...

    def describe(self, handle: int) -> str: ...


@dataclass(frozen=True)
class ScheduledRequests:
    """The requests one step computes, in compute order: cached ones, then new ones."""

    rows: np.ndarray  # int64 [n]: batch rows
    handles: np.ndarray  # int32 [n]
    num_computed: np.ndarray  # int32 [n]: tokens in the KV cache before the step
    num_scheduled: np.ndarray  # int32 [n]: tokens computed this step
    num_tokens: int  # sum of num_scheduled

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class CachedPlan:
    """The validated deltas of the cached requests, one entry per request."""

    handles: np.ndarray  # int32 [m]
    rows: np.ndarray  # int64 [m]; -1 for kept-aside requests that resume
    resumed: np.ndarray  # bool [m]: block table replaced instead of extended
    known_tokens: np.ndarray  # int64 [m]: tokens held before the step
    num_computed: np.ndarray  # int32 [m]
    num_scheduled: np.ndarray  # int32 [m]
    num_new_blocks: np.ndarray  # int64 [m]
    num_new_tokens: np.ndarray  # int64 [m]
    new_block_ids: np.ndarray  # int32 [sum num_new_blocks]
    new_token_ids: np.ndarray  # int32 [sum num_new_tokens]


@dataclass
class UpdatePlan:
    """A validated step: what InputBatch.apply changes."""

    finished: list[int]  # handles of rows to free
    preempted: list[int]  # handles of rows to free and keep aside
    dropped_parked: list[int]  # kept-aside requests that finished
    new_reqs: list[NewRequestData]
    cached: CachedPlan
    total_num_tokens: int


def plan_update(batch: BatchView, so: SchedulerOutput) -> UpdatePlan:
    """Validate so against batch; raises ValueError naming the first bad request."""
    finished_set = set(so.finished_req_handles)
    finished = [h for h in finished_set if h in batch.row_of]
    preempted = _check_preempted(batch, so.preempted_req_handles, finished_set)
    removed = finished_set | set(preempted)
    new_handles = _check_new_requests(batch, so.scheduled_new_reqs, removed)
    dropped_parked = [h for h in batch.parked if h in finished_set]
    cached = _plan_cached(batch, so, removed, finished_set, new_handles)

    num_rows = len(batch) - len(finished) - len(preempted) + len(new_handles)
    num_rows += int((cached.rows < 0).sum())
    if num_rows > batch.max_num_seqs:
        raise ValueError(
            f"step needs {num_rows} batch rows but max_num_seqs is {batch.max_num_seqs}"
        )
    total = int(cached.num_scheduled.sum())
    total += sum(r.num_scheduled_tokens for r in so.scheduled_new_reqs)
    if total != so.total_num_scheduled_tokens:
        raise ValueError(
            f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens} but the "
            f"requests schedule {total}"
        )
    if total > batch.max_num_batched_tokens:
        raise ValueError(
            f"step schedules {total} tokens, above max_num_batched_tokens "
            f"{batch.max_num_batched_tokens}"
        )
    return UpdatePlan(finished, preempted, dropped_parked, so.scheduled_new_reqs, cached, total)


# validation ---------------------------------------------------------------------------


def _check_preempted(batch: BatchView, handles: list[int], finished: set[int]) -> list[int]:
    seen: set[int] = set()
    for handle in handles:
        if handle not in batch.row_of:
            raise ValueError(f"{batch.describe(handle)}: preempted but not in the batch")
        if handle in finished or handle in seen:
            raise ValueError(f"{batch.describe(handle)}: listed twice in finished/preempted")
        seen.add(handle)
    return list(handles)


def _check_new_requests(
    batch: BatchView, reqs: list[NewRequestData], removed: set[int]
) -> set[int]:
    handles: set[int] = set()
    for req in reqs:
        name = f"request {req.req_id!r} (handle {req.req_handle})"
        if not 0 <= req.req_handle <= _MAX_HANDLE:
            raise ValueError(f"{name}: handle must be in [0, 2**31)")
        if req.req_handle in handles or (
            req.req_handle in batch.row_of and req.req_handle not in removed
        ):
            raise ValueError(f"{name}: handle already in use (duplicate handle)")
        handles.add(req.req_handle)
        try:
            req.sampling_params.validate()
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        over = req.sampling_params.logprobs_over(batch.max_logprobs)  # resolved: >= 0
        if over is not None:
            raise ValueError(f"{name}: {over[0]} {over[1]} > max_logprobs {batch.max_logprobs}")
        try:
            prompt = int32_array(req.prompt_token_ids, "prompt_token_ids", 1)
            block_ids = int32_array(req.block_ids, "block_ids", 1)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        if not 1 <= len(prompt) <= batch.max_model_len:
            raise ValueError(
                f"{name}: prompt must hold 1..{batch.max_model_len} tokens, got {len(prompt)}"
            )
        if not 0 <= req.num_output_tokens < len(prompt):
            raise ValueError(
                f"{name}: num_output_tokens {req.num_output_tokens} must be in "
                f"[0, {len(prompt)}) (its prompt_token_ids hold {len(prompt)})"
            )
        _check_token_ids(name, req.sampling_params, batch.vocab_size)
        if prompt.min() < 0 or prompt.max() >= batch.vocab_size:
            raise ValueError(f"{name}: prompt token ids must be in [0, {batch.vocab_size})")
        computed, scheduled = req.num_computed_tokens, req.num_scheduled_tokens
        if computed < 0 or scheduled < 1 or computed + scheduled > len(prompt):
            raise ValueError(
                f"{name}: num_computed {computed} + num_scheduled {scheduled} must be within "
                f"its {len(prompt)} tokens (num_scheduled >= 1)"
            )
        _check_blocks(batch, name, block_ids, computed + scheduled)
    return handles


def _check_token_ids(name: str, params: SamplingParams, vocab_size: int) -> None:
    """The token ids the sampler indexes the logits with: in the vocabulary."""
    bias = [t for t in params.logit_bias if t >= vocab_size]
    if bias:
        raise ValueError(f"{name}: logit_bias token id {bias[0]} outside [0, {vocab_size})")
    for i, word in enumerate(params.bad_words_token_ids):
        if max(word) >= vocab_size:
            raise ValueError(
                f"{name}: bad_words_token_ids[{i}] holds token id {max(word)} outside "
                f"[0, {vocab_size})"
            )
    allowed = params.allowed_token_ids
    if allowed is not None and max(allowed) >= vocab_size:  # validate() refused [] and < 0
        raise ValueError(
            f"{name}: allowed_token_ids holds token id {max(allowed)} outside [0, {vocab_size})"
        )


def _check_blocks(batch: BatchView, name: str, block_ids: np.ndarray, num_tokens: int) -> None:
    if len(block_ids) > batch.max_blocks_per_req:
        raise ValueError(
            f"{name}: {len(block_ids)} blocks, above {batch.max_blocks_per_req} per request"
        )
    bad = (block_ids < 0) | (block_ids >= batch.num_kv_blocks)
    if bad.any():
        raise ValueError(f"{name}: block id {block_ids[bad][0]} outside [0, {batch.num_kv_blocks})")
    if len(block_ids) * batch.block_size < num_tokens:
        raise ValueError(
            f"{name}: {len(block_ids)} blocks of {batch.block_size} cannot hold {num_tokens} tokens"
        )


def _plan_cached(
    batch: BatchView,
    so: SchedulerOutput,
    removed: set[int],
    finished: set[int],
    new_handles: set[int],
) -> CachedPlan:
    cached = so.scheduled_cached_reqs
    columns = int32_array(cached.columns, "CachedRequestData.columns", 2)
    if columns.shape[0] != NUM_COLUMNS:
        raise ValueError(
            f"CachedRequestData.columns must be int32 [{NUM_COLUMNS}, n], "
            f"got shape {list(columns.shape)}"
        )
    handles = columns[HANDLE].astype(np.int32)
    computed = columns[NUM_COMPUTED].astype(np.int32)
    scheduled = columns[NUM_SCHEDULED].astype(np.int32)
    num_blocks = columns[NUM_NEW_BLOCKS].astype(np.int64)
    num_tokens = columns[NUM_NEW_TOKENS].astype(np.int64)
    placeholders = columns[NUM_PLACEHOLDERS]
    block_ids = _flat(cached.new_block_ids, num_blocks, "new_block_ids", "NUM_NEW_BLOCKS")
    token_ids = _flat(cached.new_token_ids, num_tokens, "new_token_ids", "NUM_NEW_TOKENS")
    handle_list = handles.tolist()

    def fail(bad: np.ndarray, what: Callable[[int], str]) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{batch.describe(handle_list[i])}: {what(i)}")

    _check_unique(batch, handle_list, new_handles)
    resumed_set = set(cached.resumed_req_handles)
    if resumed_set - set(handle_list):
        handle = min(resumed_set - set(handle_list))
        raise ValueError(f"{batch.describe(handle)}: resumed but not among the cached requests")
    plan = functools.partial(
        CachedPlan,
        handles=handles,
        num_computed=computed,
        num_scheduled=scheduled,
        num_new_blocks=num_blocks,
        num_new_tokens=num_tokens,
        new_block_ids=block_ids,
        new_token_ids=token_ids,
    )
    if not handle_list:
        # A step of new requests only (a first step on an idle runner, its time to first
        # token): the checks below would run some twenty array operations on nothing.
        nothing = np.zeros(0, np.int64)
        return plan(rows=nothing, resumed=np.zeros(0, bool), known_tokens=nothing)
    row_of = batch.row_of
    if removed:
        rows = [-1 if h in removed else row_of.get(h, -1) for h in handle_list]
    else:
        rows = [row_of.get(h, -1) for h in handle_list]
    row_array = np.array(rows, np.int64)
    resumed = np.zeros(len(handles), bool)
    if resumed_set:
        resumed = np.isin(handles, np.array(sorted(resumed_set), np.int64))
    known = np.zeros(len(handles), np.int64)
    existing_blocks = np.zeros(len(handles), np.int64)
    active = row_array >= 0
    if batch.kv_dropped:
        dropped = np.isin(handles, np.fromiter(batch.kv_dropped, np.int64)) & active
        fail(dropped, lambda i: "its KV went with the cache a sleep released; preempt it "
             "(it is recomputed) or finish it")  # fmt: skip
    known[active] = batch.num_tokens[row_array[active]]
    extended = active & ~resumed
    existing_blocks[extended] = batch.num_blocks[row_array[extended]]
    for i in np.flatnonzero(~active).tolist():
        known[i] = _resumable_tokens(batch, handle_list[i], removed, finished, resumed[i])

    fail(scheduled < 1, lambda i: f"num_scheduled must be >= 1, got {scheduled[i]}")
    fail(computed < 0, lambda i: f"num_computed must be >= 0, got {computed[i]}")
    fail(
        computed > known,
        lambda i: f"num_computed {computed[i]} is beyond its {known[i]} known tokens",
    )
    fail((num_blocks < 0) | (num_tokens < 0), lambda i: "negative new block or token count")
    after = np.maximum(known, computed + num_tokens)
    fail(after > batch.max_model_len + 1, lambda i: f"{after[i]} tokens > max_model_len")
    end = computed.astype(np.int64) + scheduled
    fail(
        end > after,
        lambda i: (
            f"num_computed {computed[i]} + num_scheduled {scheduled[i]} exceeds its "
            f"{after[i]} tokens"
        ),
    )
    fail(end > batch.max_model_len, lambda i: f"reaches {end[i]} tokens > max_model_len")
    if placeholders.any():
        check_placeholders(
            batch.last_sampled, fail, placeholders, row_array, resumed, computed, end, num_tokens
        )
    blocks_after = existing_blocks + num_blocks
    fail(
        blocks_after > batch.max_blocks_per_req,
        lambda i: f"{blocks_after[i]} blocks, above {batch.max_blocks_per_req} per request",
    )
    fail(
        blocks_after * batch.block_size < end,
        lambda i: f"{blocks_after[i]} blocks of {batch.block_size} cannot hold {end[i]} tokens",
    )
    _check_flat_range(batch, handle_list, block_ids, num_blocks, batch.num_kv_blocks, "block id")
    _check_flat_range(batch, handle_list, token_ids, num_tokens, batch.vocab_size, "token id")
    return plan(rows=row_array, resumed=resumed, known_tokens=known)


def _check_unique(batch: BatchView, handles: list[int], new_handles: set[int]) -> None:
    if len(set(handles)) == len(handles) and not new_handles.intersection(handles):
        return
    seen = set(new_handles)
    for handle in handles:
        if handle in seen:
            raise ValueError(f"{batch.describe(handle)}: scheduled twice (duplicate handle)")
        seen.add(handle)


def _resumable_tokens(
    batch: BatchView, handle: int, removed: set[int], finished: set[int], resumed: bool
) -> int:
    """The token count of a cached request that has no row: it must be kept aside (it was
    preempted in an earlier step) and named as resumed."""
    parked = batch.parked.get(handle)
    if parked is None or handle in finished:
        reason = "finished or preempted in this step" if handle in removed else "unknown"
        raise ValueError(f"{batch.describe(handle)}: {reason}; it is not in the batch")
    if not resumed:
        raise ValueError(f"{batch.describe(handle)}: was preempted; send it as resumed or as new")
    return len(parked.token_ids)


def _check_flat_range(
    batch: BatchView,
    handles: list[int],
    values: np.ndarray,
    counts: np.ndarray,
    limit: int,
    what: str,
) -> None:
    """Every value in [0, limit); an error names the request that owns the first bad one."""
    if len(values) == 0:
        return
    bad = (values < 0) | (values >= limit)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        owner = int(np.searchsorted(np.cumsum(counts), k, side="right"))
        raise ValueError(
            f"{batch.describe(handles[owner])}: {what} {values[k]} outside [0, {limit})"
        )


def _flat(values: np.ndarray | None, counts: np.ndarray, name: str, column: str) -> np.ndarray:
    """A ragged field's values (nil: none), as many as its count column says."""
    flat = np.zeros(0, np.int32) if values is None else int32_array(values, name, 1)
    if len(flat) != int(counts.sum()):
        raise ValueError(f"{name} holds {len(flat)} values but {column} sums to {counts.sum()}")
    return flat
