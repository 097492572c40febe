"""A request's prompt logprobs, held by the engine core until its first output: the
workers send each step's rows (a chunked prefill's over several steps) and the request
gets them all at once with its first token, a row per prompt position after the first.

Such a request takes no prefix-cache hits and shares no sibling's prompt blocks
(engine/prompt_sharing.py), as vLLM: every prompt position is computed, so every row
comes. Of a prompt's n samples the client asks with the first only, and gives its rows
to the others (frontend/output_processor.py), which share its prompt blocks. A prefill
computed again (after a preemption) sends rows it holds already: those are dropped.
"""

from __future__ import annotations

import numpy as np

from messages import LogprobsLists


class PromptLogprobRows:
    """The rows of one request's prompt positions 1.. so far, k + 1 columns each."""

    def __init__(self, req_id: str, num_top: int) -> None:
        self.req_id = req_id
        self.num_columns = num_top + 1
        self.num_rows = 0  # rows held: positions 1..num_rows
        self._parts: list[LogprobsLists] = []

    def add(self, first_position: int, rows: LogprobsLists, start: int, count: int) -> None:
        """Rows [start, start + count) of a step's, for prompt positions first_position on."""
        skip = self.num_rows + 1 - first_position
        if skip < 0:
            raise RuntimeError(
                f"request {self.req_id!r}: prompt logprobs from position {first_position}, "
                f"it holds positions 1..{self.num_rows}"
            )
        if skip >= count:
            return
        a, b, k = start + skip, start + count, self.num_columns
        self._parts.append(
            LogprobsLists(
                np.array(rows.logprob_token_ids[a:b, :k], np.int32),
                np.array(rows.logprobs[a:b, :k], np.float32),
                np.array(rows.sampled_token_ranks[a:b], np.int32),
            )
        )
        self.num_rows += b - a

    def take(self) -> LogprobsLists:
        """Every row held, as one LogprobsLists (its parts are let go)."""
        parts, self._parts = self._parts, []
        if not parts:  # a one-token prompt
            k = self.num_columns
            return LogprobsLists(
                np.zeros((0, k), np.int32), np.zeros((0, k), np.float32), np.zeros(0, np.int32)
            )
        return join_rows(parts)


def join_rows(parts: list[LogprobsLists]) -> LogprobsLists:
    """parts' rows one after the other (at least one part, all of as many columns)."""
    if len(parts) == 1:
        return parts[0]
    return LogprobsLists(
        np.concatenate([p.logprob_token_ids for p in parts]),
        np.concatenate([p.logprobs for p in parts]),
        np.concatenate([p.sampled_token_ranks for p in parts]),
    )
