"""One step as the scheduler fills it, from positions in the running table, and its
sending: the SchedulerOutput, and the table and the steps in flight moved on.

Decodes that need nothing of the block manager go in as whole arrays of positions
(add_decodes); requests with new blocks, new tokens for the workers, or a prefill chunk
go in one by one (add_one). Nothing of the table changes until send(): every count is
read as it was when the step was built.
"""

from __future__ import annotations

import numpy as np

from messages import CachedRequestData, KVConnectorMetadata, NewRequestData, SchedulerOutput
from messages.step import (
    HANDLE,
    NUM_COLUMNS,
    NUM_COMPUTED,
    NUM_NEW_BLOCKS,
    NUM_NEW_TOKENS,
    NUM_PLACEHOLDERS,
    NUM_SCHEDULED,
)
from zmqworker.engine.in_flight import SentStep, StepsInFlight
from zmqworker.engine.running import RunningTable


def _flat(rows: list[list[int]]) -> np.ndarray | None:
    values = [v for row in rows for v in row]
    return np.array(values, np.int32) if values else None


class StepDraft:
    """The requests of a step being built: cached ones as deltas, then new ones whole."""

    def __init__(self, table: RunningTable) -> None:
        self.table = table
        self.num_reqs = 0
        self.num_tokens = 0
        self.new_reqs: list[NewRequestData] = []
        # Cached requests, in step order: parts of (positions, tokens each or None for one
        # each, samples or None for all).
        self._parts: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        # Requests added one by one since the last part: position, tokens, samples.
        self._one: list[tuple[int, int, bool]] = []
        # Their new blocks and tokens for the workers, and where they sit among the
        # cached requests.
        self._blocks: list[list[int]] = []
        self._tokens: list[list[int]] = []
        self._one_rows: list[int] = []
        self._num_cached = 0
        self._new: list[tuple[int, int, bool]] = []  # new requests: position, tokens, samples

    def __len__(self) -> int:
        return self.num_reqs

    def in_step(self) -> np.ndarray:
        """Which running requests (by position) are in the step so far: a mask."""
        mask = np.zeros(len(self.table), bool)
        for positions, _, _ in self._parts:
            mask[positions] = True
        for position, _, _ in (*self._one, *self._new):
            mask[position] = True
        return mask

    def add_decodes(self, positions: np.ndarray) -> None:
        """Running requests that compute one token each and sample it, needing no new
        block and no token sent."""
        if not len(positions):
            return
        self._flush()
        self._parts.append((positions, None, None))
        self._num_cached += len(positions)
        self.num_reqs += len(positions)
        self.num_tokens += len(positions)

    def add_one(
        self,
        position: int,
        num_new: int,
        new_blocks: list[int],
        samples: bool,
        new_tokens: list[int] | None = None,
    ) -> None:
        """A running request computing num_new tokens, with the blocks it newly took and
        (pipeline stages that do not sample) the tokens its workers lack."""
        self._one.append((position, num_new, samples))
        self._blocks.append(new_blocks)
        self._tokens.append(new_tokens or [])
        self.num_reqs += 1
        self.num_tokens += num_new

    def add_new(self, position: int, num_new: int, block_ids: list[int], samples: bool) -> None:
        """A request the workers do not hold (just added to the table), from its computed
        tokens (prefix hits) on."""
        table = self.table
        request = table.requests[position]
        assert request.handle is not None
        self.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                req_handle=request.handle,
                prompt_token_ids=np.array(request.all_token_ids, np.int32),
                sampling_params=request.sampling_params.for_workers(),
                block_ids=np.array(block_ids, np.int32),
                num_scheduled_tokens=num_new,
                num_computed_tokens=int(table.computed[position]),
                num_output_tokens=len(request.all_token_ids) - request.num_prompt_tokens,
                eos_token_ids=request.eos_token_list,
            )
        )
        self._new.append((position, num_new, samples))
        self.num_reqs += 1
        self.num_tokens += num_new

    def send(
        self,
        in_flight: StepsInFlight,
        finished: list[int],
        preempted: list[int],
        with_placeholders: bool,
        kv_connector_metadata: KVConnectorMetadata | None = None,
    ) -> SchedulerOutput:
        """The SchedulerOutput (with the KV connector's orders, if any: such a step may
        compute no request); the requests' tokens counted as computed and the step as
        in flight."""
        positions, num_new, samples = self._gather()
        table = self.table
        handles, computed = table.handle[positions], table.computed[positions]
        m = self._num_cached
        cached = np.zeros((NUM_COLUMNS, m), np.int32)
        cached[HANDLE] = handles[:m]
        cached[NUM_COMPUTED] = computed[:m]
        scheduled = num_new if isinstance(num_new, int) else num_new[:m]
        cached[NUM_SCHEDULED] = scheduled
        if with_placeholders:
            # Its last scheduled position is past the known tokens: the worker samples it.
            cached[NUM_PLACEHOLDERS] = computed[:m] + scheduled > table.known[positions[:m]]
        if any(self._blocks):
            cached[NUM_NEW_BLOCKS, self._one_rows] = [len(r) for r in self._blocks]
        if any(self._tokens):
            cached[NUM_NEW_TOKENS, self._one_rows] = [len(r) for r in self._tokens]
        output = SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                cached, _flat(self._blocks), _flat(self._tokens)
            ),
            total_num_scheduled_tokens=self.num_tokens,
            finished_req_handles=finished,
            preempted_req_handles=preempted,
            kv_connector_metadata=kv_connector_metadata,
        )
        table.computed[positions] = computed + num_new
        sampling = handles if samples is None else handles[samples]
        structured = table.structured[positions]
        if samples is not None:
            structured = structured & samples
        in_flight.add(
            SentStep(output, handles, sampling, finished, handles[structured.nonzero()[0]])
        )
        return output

    def _gather(self) -> tuple[np.ndarray, np.ndarray | int, np.ndarray | None]:
        """Every request's position, tokens and whether it samples, in step order (the
        new requests last); 1 and None where each computes one token and samples it."""
        self._flush()
        parts = list(self._parts)
        if not parts and not self._new:  # a step of KV connector orders only
            return np.zeros(0, np.int64), 1, None
        if self._new:
            positions, num_new, samples = zip(*self._new, strict=True)
            parts.append((np.array(positions), np.array(num_new), np.array(samples, bool)))
        if len(parts) == 1:
            positions, num_new, samples = parts[0]
            return positions, 1 if num_new is None else num_new, samples
        sizes = [len(p) for p, _, _ in parts]
        return (
            np.concatenate([p for p, _, _ in parts]),
            np.concatenate(
                [
                    np.ones(k, np.int64) if t is None else t
                    for k, (_, t, _) in zip(sizes, parts, strict=True)
                ]
            ),
            np.concatenate(
                [
                    np.ones(k, bool) if f is None else f
                    for k, (_, _, f) in zip(sizes, parts, strict=True)
                ]
            ),
        )

    def _flush(self) -> None:
        """The requests added one by one since the last part, as a part."""
        if not self._one:
            return
        positions, num_new, samples = zip(*self._one, strict=True)
        self._one_rows.extend(range(self._num_cached, self._num_cached + len(positions)))
        self._parts.append(
            (np.array(positions, np.int64), np.array(num_new, np.int64), np.array(samples, bool))
        )
        self._num_cached += len(positions)
        self._one = []
