"""A request's life in the engine core: its tokens, status and the stop rules that need
no text (EOS and stop token ids, max_tokens, max_model_len). Text, stop strings and
timings are the client's (zmqworker/frontend/request_state.py)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

import numpy as np

from messages import EngineCoreOutput, LogprobsLists, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to start over
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens, or the model's max_model_len
    ABORT = "abort"


class Request:
    """One generation request. The scheduler moves it between states; append_output_token
    applies the stop rules to each sampled token; take_output hands what is new to the
    client.

    all_token_ids is the prompt followed by the outputs. What the scheduler counts of a
    running request (tokens computed, steps in flight) is its own (running.py, in_flight.py).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        self.req_id = req_id
        self.prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token_list = sorted(self.eos_token_ids)  # as the workers get them
        # The tokens that end the output once past min_tokens.
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else self.eos_token_ids
        )
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None  # the stop token id hit
        self.handle: int | None = None  # set while the workers hold it
        self.num_cached_tokens = 0  # prefix-cache hits when it was last scheduled as new
        self.num_preemptions = 0
        # The logprobs rows of the tokens not taken yet (take_output), when asked for:
        # (top ids, their logprobs, the sampled token's rank) each.
        self._logprob_rows: list[tuple[np.ndarray, np.ndarray, int]] | None = (
            None if sampling_params.logprobs is None else []
        )
        self._tokens_taken = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
            f"outputs={len(self.all_token_ids) - self.num_prompt_tokens})"
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(
        self,
        token_id: int,
        max_model_len: int,
        logprobs: LogprobsLists | None = None,
        row: int = 0,
    ) -> bool:
        """Record a sampled token (and its logprobs: row `row` of the step's) and apply
        the stop rules; True if the request is finished now. EOS and the stop token ids end
        the output only after its first min_tokens tokens (vLLM's rule: the workers hold
        the stop tokens back until then). The scheduler appends most tokens itself, in
        bulk, and calls this only where stop_token_ids or length_limit say it may finish
        (or logprobs are kept)."""
        if self.status is RequestStatus.FINISHED:
            raise RuntimeError(f"request {self.req_id!r} is finished; got token {token_id}")
        if self._logprob_rows is not None:
            self._logprob_rows.append(self._logprob_row(token_id, logprobs, row))
        self.all_token_ids.append(token_id)
        params = self.sampling_params
        num_outputs = len(self.all_token_ids) - self.num_prompt_tokens
        if num_outputs > params.min_tokens and token_id in self.stop_token_ids:
            self.stop_reason = token_id
            self.finish(FinishReason.STOP)
            return True
        if len(self.all_token_ids) >= self.length_limit(max_model_len):
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def length_limit(self, max_model_len: int) -> int:
        """The number of tokens (prompt and outputs) at which it ends by length."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, max_model_len)

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def take_output(self) -> EngineCoreOutput:
        """The output tokens (and their logprobs rows) not taken before, and how the
        request ended once it has (by its stop rules: an aborted request has no more
        outputs)."""
        tokens = self.all_token_ids[self.num_prompt_tokens + self._tokens_taken :]
        self._tokens_taken += len(tokens)
        logprobs = None
        if self._logprob_rows:
            ids, values, ranks = zip(*self._logprob_rows, strict=True)
            logprobs = LogprobsLists(np.stack(ids), np.stack(values), np.array(ranks, np.int32))
            self._logprob_rows = []
        reason = self.finish_reason
        return EngineCoreOutput(
            self.req_id,
            tokens,
            finish_reason=None if reason is None else reason.value,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _logprob_row(
        self, token_id: int, logprobs: LogprobsLists | None, row: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The row's sampled token (column 0) and its first n top tokens, copied out of
        the step's reply."""
        if logprobs is None:
            raise RuntimeError(
                f"request {self.req_id!r} asked for logprobs but the step returned none"
            )
        n = self.sampling_params.logprobs or 0
        ids = np.array(logprobs.logprob_token_ids[row, : n + 1], np.int32)
        if len(ids) < n + 1 or ids[0] != token_id:
            raise RuntimeError(
                f"request {self.req_id!r}: the step's logprobs row {row} ({ids[:1].tolist()}, "
                f"{len(ids) - 1} top) does not hold token {token_id} and {n} top tokens"
            )
        values = np.array(logprobs.logprobs[row, : n + 1], np.float32)
        return ids, values, int(logprobs.sampled_token_ranks[row])
