"""The persistent input batch: every request the worker holds, one batch row each.

Per-request state lives in preallocated arrays indexed by row (token ids, block table,
counters, sampling settings), so a step's inputs are gathered with a few vectorised numpy
operations instead of per-request Python. Requests are found by their int handle. A
preempted request leaves its row but is kept aside, so that it can come back as resumed.
On the stage that samples, the penalties' state of each row (penalty_rows.py) joins and
leaves with it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from messages import NewRequestData, SamplingParams, SchedulerOutput
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.batch_update import (
    CachedPlan,
    ScheduledRequests,
    UpdatePlan,
    plan_update,
)
from zmqworker.model_runner.penalty_rows import PenaltyRows

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment


@dataclass
class ParkedRequest:
    """A preempted request's state, until it is resumed, re-sent as new or finished."""

    req_id: str
    token_ids: np.ndarray  # int32: prompt followed by the outputs so far
    num_prompt: int  # of token_ids, the prompt's
    params: SamplingParams
    eos_token_ids: list[int]


class InputBatch:
    """Rows 0..max_num_seqs-1; a free row has handle -1. samples: this stage samples
    (it keeps the penalties' state)."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        vocab_size: int,
        max_logprobs: int,
        device: torch.device,
        samples: bool = True,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_logprobs = vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)
        self.device = device
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.num_kv_blocks = 0  # block ids must be below this; 0 until the KV cache exists

        # One column more than max_model_len: a request may sample after its last position.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_prompt = np.zeros(max_num_seqs, np.int32)  # the first outputs' position
        self.last_sampled = np.full(max_num_seqs, -1, np.int64)  # a placeholder's position
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.handles = np.full(max_num_seqs, -1, np.int32)
        # How often each row has been taken: what tells a sample's request from a later
        # one in its row (the engine hands a dropped handle out again).
        self.tenures = np.zeros(max_num_seqs, np.int64)
        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.eos_token_ids: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.temperature = np.zeros(max_num_seqs, np.float32)
        self.top_k = np.zeros(max_num_seqs, np.int32)
        self.top_p = np.ones(max_num_seqs, np.float32)
        self.min_p = np.zeros(max_num_seqs, np.float32)
        self.num_logprobs = np.full(max_num_seqs, -1, np.int32)
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, np.int32)  # -1: none asked
        self.seeded = np.zeros(max_num_seqs, bool)
        self.seeds = np.zeros(max_num_seqs, np.int64)
        self.penalties = PenaltyRows(max_num_seqs, vocab_size, device) if samples else None

        self.row_of: dict[int, int] = {}
        self.parked: dict[int, ParkedRequest] = {}
        # Requests in rows whose KV a released cache took with it (sleep): they may only
        # finish or be preempted, which recomputes them.
        self.kv_dropped: set[int] = set()
        self._free_rows = list(range(max_num_seqs))

    # the step -------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> ScheduledRequests:
        """Apply one step's changes and return the requests it computes. Raises ValueError
        naming the request on bad input, before changing anything."""
        return self.apply(plan_update(self, scheduler_output))

    def apply(self, plan: UpdatePlan) -> ScheduledRequests:
        """Make a validated step's changes; returns the requests the step computes."""
        for handle in plan.finished:
            self.remove_request(handle, park=False)
        for handle in plan.preempted:
            self.remove_request(handle, park=True)
        for handle in plan.dropped_parked:
            del self.parked[handle]
        cached = plan.cached
        rows = cached.rows
        if len(rows):
            for i in np.flatnonzero(rows < 0).tolist():
                rows[i] = self.resume_request(int(cached.handles[i]))
            self.num_blocks[rows[cached.resumed]] = 0
            self._append_tokens(cached)
            self._append_blocks(cached)
        new = plan.new_reqs
        new_rows = [self.add_request(r) for r in new]
        if self.penalties is not None:
            self.penalties.flush()
        if not new:
            return ScheduledRequests(
                rows,
                cached.handles,
                cached.num_computed,
                cached.num_scheduled,
                plan.total_num_tokens,
            )
        return ScheduledRequests(
            rows=np.concatenate([rows, np.array(new_rows, np.int64)]),
            handles=np.concatenate(
                [cached.handles, np.array([r.req_handle for r in new], np.int32)]
            ),
            num_computed=np.concatenate(
                [cached.num_computed, np.array([r.num_computed_tokens for r in new], np.int32)]
            ),
            num_scheduled=np.concatenate(
                [cached.num_scheduled, np.array([r.num_scheduled_tokens for r in new], np.int32)]
            ),
            num_tokens=plan.total_num_tokens,
        )

    def claim_positions(self, rows: np.ndarray) -> np.ndarray:
        """Each row's next position, claimed for its sample (the id may come later):
        the position counters move at once, so the next step is validated against them."""
        positions = self.num_tokens[rows].copy()
        self.num_tokens[rows] += 1
        self.last_sampled[rows] = positions
        return positions

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append each row's sampled token after its known tokens."""
        self.token_ids[rows, self.claim_positions(rows)] = token_ids

    # queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.row_of)

    def check_blocks_within(self, num_blocks: int) -> None:
        """ValueError naming a request whose block table reaches past num_blocks (a new,
        smaller KV cache): its steps would read and write outside the cache."""
        for handle, row in self.row_of.items():
            held = self.block_table[row, : self.num_blocks[row]]
            if len(held) and held.max() >= num_blocks:
                raise ValueError(
                    f"{self.describe(handle)} holds block {held.max()}, past the {num_blocks} "
                    "blocks of the new KV cache"
                )

    def check_no_requests(self, what: str) -> None:
        """RuntimeError naming a request the worker holds (in a row, or preempted and
        kept aside): what would overwrite the KV cache their next steps read."""
        held = [*self.row_of, *self.parked]
        if held:
            raise RuntimeError(
                f"{what} while {len(held)} request(s) are unfinished, "
                f"{self.describe(held[0])} among them: it would overwrite the KV cache "
                "they read; finish them first (finished_req_handles)"
            )

    def describe(self, handle: int) -> str:
        """How errors name a request: its req_id (when known) and handle."""
        row = self.row_of.get(handle)
        req_id = self.req_ids[row] if row is not None else None
        if req_id is None and handle in self.parked:
            req_id = self.parked[handle].req_id
        return f"request {req_id!r} (handle {handle})" if req_id else f"request handle {handle}"

    def tokens_of(self, handle: int) -> np.ndarray:
        """A copy of the request's known tokens (prompt and outputs)."""
        row = self.row_of[handle]
        return self.token_ids[row, : self.num_tokens[row]].copy()

    def sample_seeds(self, rows: np.ndarray) -> dict[int, int]:
        """{position in rows: draw seed} for the seeded requests among rows (each about to
        sample its next token), each from the request's seed and how many tokens it has
        sampled: its draws depend on nothing else, so a request preempted and recomputed,
        or sent again as new, samples as if it never was. The sampler seeds a generator
        from it only where the request samples at random."""
        seeded = np.flatnonzero(self.seeded[rows])
        if not len(seeded):
            return {}
        at = rows[seeded]
        draws = draw_seeds(self.seeds[at], self.num_tokens[at] - self.num_prompt[at])
        return dict(zip(seeded.tolist(), draws.tolist(), strict=True))

    # row operations (apply calls these after planning validated them) ----------------

    def add_request(self, new: NewRequestData) -> int:
        """A new request (or one that starts over) takes a row; any state kept aside for
        its handle is dropped."""
        self.parked.pop(new.req_handle, None)
        row = self._take_row(new.req_handle, new.req_id)
        prompt = np.asarray(new.prompt_token_ids)
        self.token_ids[row, : len(prompt)] = prompt
        self.num_tokens[row] = len(prompt)
        blocks = np.asarray(new.block_ids)
        self.block_table[row, : len(blocks)] = blocks
        self.num_blocks[row] = len(blocks)
        self.num_prompt[row] = len(prompt) - new.num_output_tokens
        self._set_params(row, new.sampling_params, new.eos_token_ids, prompt)
        return row

    def remove_request(self, handle: int, park: bool) -> None:
        """Free the request's row; a preempted request (park=True) is kept aside."""
        row = self.row_of.pop(handle)
        self.kv_dropped.discard(handle)
        if park:
            req_id, params = self.req_ids[row], self.params[row]
            assert req_id is not None and params is not None
            self.parked[handle] = ParkedRequest(
                req_id,
                self.token_ids[row, : self.num_tokens[row]].copy(),
                int(self.num_prompt[row]),
                params,
                self.eos_token_ids[row],
            )
        self.handles[row] = -1
        self.req_ids[row] = None
        self.params[row] = None
        self.eos_token_ids[row] = []
        self.seeded[row] = False
        if self.penalties is not None:
            self.penalties.remove(row)
        heapq.heappush(self._free_rows, row)

    def resume_request(self, handle: int) -> int:
        """Bring a parked request back into a row, with an empty block table."""
        parked = self.parked.pop(handle)
        row = self._take_row(handle, parked.req_id)
        self.token_ids[row, : len(parked.token_ids)] = parked.token_ids
        self.num_tokens[row] = len(parked.token_ids)
        self.num_prompt[row] = parked.num_prompt
        self.num_blocks[row] = 0
        self._set_params(row, parked.params, parked.eos_token_ids, parked.token_ids)
        return row

    def _append_tokens(self, cached: CachedPlan) -> None:
        """Append each request's new tokens that lie beyond its known ones."""
        count = np.maximum(cached.num_computed + cached.num_new_tokens - cached.known_tokens, 0)
        total = int(count.sum())
        if total == 0:
            return
        rows = cached.rows
        offsets = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        source = np.repeat(np.cumsum(cached.num_new_tokens) - count, count) + offsets
        target = np.repeat(cached.known_tokens, count) + offsets
        self.token_ids[np.repeat(rows, count), target] = cached.new_token_ids[source]
        self.num_tokens[rows] = cached.known_tokens + count

    def _append_blocks(self, cached: CachedPlan) -> None:
        count = cached.num_new_blocks
        total = len(cached.new_block_ids)
        if total == 0:
            return
        rows = cached.rows
        offsets = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        target = np.repeat(self.num_blocks[rows], count) + offsets
        self.block_table[np.repeat(rows, count), target] = cached.new_block_ids
        self.num_blocks[rows] += count.astype(np.int32)

    def _take_row(self, handle: int, req_id: str) -> int:
        row = heapq.heappop(self._free_rows)
        self.row_of[handle] = row
        self.handles[row] = handle
        self.tenures[row] += 1
        self.last_sampled[row] = -1
        self.req_ids[row] = req_id
        return row

    def _set_params(
        self,
        row: int,
        params: SamplingParams,
        eos_token_ids: list[int],
        token_ids: np.ndarray,
    ) -> None:
        """token_ids: the request's tokens (the first num_prompt[row] its prompt)."""
        self.params[row] = params
        self.eos_token_ids[row] = eos_token_ids
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        prompt_logprobs = params.prompt_logprobs
        self.num_prompt_logprobs[row] = -1 if prompt_logprobs is None else prompt_logprobs
        self.seeded[row] = params.seed is not None
        self.seeds[row] = params.seed or 0
        if self.penalties is not None:
            self.penalties.add(row, params, token_ids, int(self.num_prompt[row]), eos_token_ids)


def draw_seeds(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The seed of each request's draw number draws (int64 columns), as uint64: SplitMix64
    of the two, so that nearby seeds and draws give unrelated streams (a CPU generator
    keeps the low 32 bits)."""
    x = seeds.astype(np.uint64) + (draws.astype(np.uint64) + np.uint64(1)) * _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
