"""The running requests as columns: the scheduler's counters of each, one position per
request in the order they started (the last is the newest).

The scheduler reads these every step for every running request, so they are numpy
columns rather than attributes of each Request: a decode step is built, and its sampled
tokens applied, by array operations. A request's tokens stay on its Request
(all_token_ids); the columns hold what the scheduler counts of it. A request leaves
(finished, aborted, preempted) by remove(), which closes the gap, keeping the order.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.in_flight import StepsInFlight
from zmqworker.engine.request import Request

COUNTERS = (
    "handle",
    "computed",  # tokens whose KV is computed, or scheduled into the cache by steps sent
    "known",  # len(all_token_ids): the prompt and the outputs sampled so far
    # At this many tokens it ends: Request.length_limit, or after its first token for a
    # prefill instance's request (remote_decode), which then goes on elsewhere.
    "length_limit",
    # Once it holds this many tokens, each token it samples goes through Request's stop
    # rules (append_output_token): one short of its length limit, or -1 (from the
    # start) when it keeps logprobs.
    "look_at",
    # 1 if it has a grammar: the steps that sample for it need its bitmask (its matcher
    # takes its tokens then; those that may end the grammar are in stop_ids).
    "structured",
    "full_blocks_told",  # full blocks the block manager was last told of (prefix caching)
    "tokens_sent",  # tokens its workers hold (pipeline stages that do not sample)
)


class RunningTable:
    """Complete once constructed (empty). Not thread-safe: the scheduler owns it.

    Each counter is an attribute: a numpy row by position, as long as the capacity
    (the running requests are the first len(self) positions)."""

    handle: np.ndarray
    computed: np.ndarray
    known: np.ndarray
    length_limit: np.ndarray
    look_at: np.ndarray
    structured: np.ndarray
    full_blocks_told: np.ndarray
    tokens_sent: np.ndarray

    def __init__(self, capacity: int = 16) -> None:
        self.requests: list[Request] = []
        self._columns = np.zeros((len(COUNTERS), capacity), np.int64)
        # Each request's stop token ids (and its grammar's), padded with -1 (never
        # sampled): row k holds the k-th of each; as many rows as the most any had.
        self.stop_ids = np.full((1, capacity), -1, np.int32)
        self.position_of_handle = np.full(capacity, -1, np.int64)
        self._bind()

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, num_computed: int, max_model_len: int) -> int:
        """A request starts running (with num_computed tokens cached); its position."""
        assert request.handle is not None
        n = len(self.requests)
        grammar = request.grammar
        stop = sorted(request.stop_token_ids | (grammar.stop_token_ids if grammar else set()))
        if n == self._columns.shape[1] or len(stop) > len(self.stop_ids):
            self._grow(2 * self._columns.shape[1], max(len(stop), len(self.stop_ids)))
        if request.handle >= len(self.position_of_handle):
            grown = np.full(2 * request.handle + 2, -1, np.int64)
            grown[: len(self.position_of_handle)] = self.position_of_handle
            self.position_of_handle = grown
        known = len(request.all_token_ids)
        limit = request.length_limit(max_model_len)
        if request.remote_decode:
            limit = min(limit, known + 1)
        values = (
            request.handle,
            num_computed,
            known,
            limit,
            -1 if request.sampling_params.logprobs is not None else limit - 1,
            int(grammar is not None),
            0,
            known,
        )
        self._columns[:, n] = values
        self.stop_ids[:, n] = -1
        self.stop_ids[: len(stop), n] = stop
        self.position_of_handle[request.handle] = n
        self.requests.append(request)
        return n

    def remove(self, positions: Iterable[int]) -> None:
        """Requests leave; those after them move up, in order."""
        gone = set(positions)
        if not gone:
            return
        keep = np.array([p for p in range(len(self.requests)) if p not in gone], np.int64)
        self.position_of_handle[self.handle[list(gone)]] = -1
        m = len(keep)
        self._columns[:, :m] = self._columns[:, keep]
        self.stop_ids[:, :m] = self.stop_ids[:, keep]
        self.requests = [self.requests[p] for p in keep.tolist()]
        self.position_of_handle[self.handle[:m]] = np.arange(m)

    def computed_of(self, request: Request) -> int:
        """A running request's computed tokens (those of the steps sent so far)."""
        assert request.handle is not None
        return int(self.computed[self.position_of_handle[request.handle]])

    def clear(self) -> None:
        self.requests = []
        self.position_of_handle[:] = -1

    def ready(
        self,
        in_flight: StepsInFlight,
        kv: KVBlockManager,
        async_scheduling: bool,
        send_token_ids: bool,
    ) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """The running requests a step can take now: (tokens each has left to compute
        before it samples again, by position; the decodes' positions, in order; which
        of those (indices into them) need the block manager or tokens sent; the
        positions of the others, mid-prefill). A request in a step in flight is ready
        only with async scheduling, going on from that step, unless it ends by length
        there."""
        n = len(self.requests)
        handles, computed = self.handle[:n], self.computed[:n]
        known_then = self.known[:n] + in_flight.num_samples[handles]
        num_left = known_then - computed
        ready = in_flight.num_steps[handles] == 0
        if async_scheduling:
            ready |= known_then < self.length_limit[:n]
        is_decode = ready & (num_left == 1)
        decodes = is_decode.nonzero()[0]
        all_decode = len(decodes) == n
        # A decode needs the block manager when its token starts a block (a request holds
        # blocks for its computed tokens, no more: they are all full), or when a block of
        # known tokens has filled since it was last told (prefix caching).
        if send_token_ids:
            slow = list(range(len(decodes)))
        else:
            at = computed if all_decode else computed[decodes]
            needs_block = at % kv.block_size == 0
            if kv.enable_prefix_caching:
                known = self.known[:n] if all_decode else self.known[decodes]
                full = np.minimum(at + 1, known) // kv.block_size
                needs_block |= full > self.full_blocks_told[decodes]
            slow = needs_block.nonzero()[0].tolist()
        others = [] if all_decode else (ready & ~is_decode).nonzero()[0].tolist()
        return num_left, decodes, slow, others

    def append_tokens(self, positions: np.ndarray, tokens: list[int]) -> None:
        """Each request at positions samples its token (no stop rule applies: see
        may_finish)."""
        requests = self.requests
        for position, token in zip(positions.tolist(), tokens, strict=True):
            requests[position].all_token_ids.append(token)
        self.known[positions] += 1

    def may_finish(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Which of these requests' next tokens could end them (a stop token id, one that
        ends a grammar, the length limit) or need a look of their own (logprobs): a mask
        over positions. Request decides (append_output_token)."""
        look = self.known[positions] >= self.look_at[positions]
        for stop_ids in self.stop_ids:
            look |= stop_ids[positions] == tokens
        return look

    def _grow(self, capacity: int, stop_width: int) -> None:
        n = len(self.requests)
        columns = np.zeros((len(COUNTERS), capacity), np.int64)
        columns[:, :n] = self._columns[:, :n]
        stop_ids = np.full((stop_width, capacity), -1, np.int32)
        stop_ids[: len(self.stop_ids), :n] = self.stop_ids[:, :n]
        self._columns, self.stop_ids = columns, stop_ids
        self._bind()

    def _bind(self) -> None:
        for row, name in enumerate(COUNTERS):
            setattr(self, name, self._columns[row])
