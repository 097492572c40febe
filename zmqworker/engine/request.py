"""A request's life in the engine: its tokens, status, stop rules and timings."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from messages import LogprobsLists, SamplingParams
from zmqworker.engine.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to start over
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's max_model_len
    ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log probability; text is the token decoded alone (None when the
    model has no tokenizer)."""

    token_id: int
    logprob: float
    text: str | None


@dataclass(frozen=True)
class PositionLogprobs:
    """One generated position: the sampled token with its rank in the vocabulary (1: the
    most likely), and the n most likely tokens there, most likely first."""

    sampled: TokenLogprob
    rank: int
    top: list[TokenLogprob]


@dataclass(frozen=True)
class RequestTimings:
    """Seconds: time to first token, mean time per output token after the first, and
    arrival to finish."""

    ttft: float
    tpot: float
    total: float


class Request:
    """One generation request. The scheduler moves it between states; append_output_token
    applies the stop rules to each sampled token.

    Token counts: all_token_ids is the prompt followed by the outputs; num_computed_tokens
    of them have their KV in the cache (or scheduled into it).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] = (),
        detokenizer: IncrementalDetokenizer | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        if sampling_params.stop and detokenizer is None:
            raise ValueError(f"request {req_id!r}: stop strings need a tokenizer (detokenizer)")
        self.req_id = req_id
        self.prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token_list = sorted(self.eos_token_ids)  # as the workers get them
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string hit
        self.handle: int | None = None  # set while the workers hold it
        self.num_computed_tokens = 0
        # The scheduler's: steps sent and not back yet that compute it, and the tokens
        # those steps sample for it (placeholders for the next step, async scheduling).
        self.num_steps_in_flight = 0
        self.num_pending_samples = 0
        self.num_cached_tokens = 0  # prefix-cache hits when it was last scheduled as new
        self.num_preemptions = 0
        self.output_text = ""
        # One entry per output token when sampling_params.logprobs is set, else None.
        self.logprobs: list[PositionLogprobs] | None = (
            None if sampling_params.logprobs is None else []
        )
        self._detokenizer = detokenizer
        # Streamed text stays this many characters behind, since they could still turn
        # out to start a stop string (which is trimmed from the output).
        self._holdback = max((len(s) for s in sampling_params.stop), default=1) - 1
        self._tokens_taken = 0
        self._text_taken = 0

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
            f"outputs={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def text_taken(self) -> int:
        """Characters of output_text that take_delta has returned."""
        return self._text_taken

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(
        self,
        token_id: int,
        max_model_len: int,
        now: float | None = None,
        logprobs: LogprobsLists | None = None,
        row: int = 0,
    ) -> bool:
        """Record a sampled token (and its logprobs: row `row` of the step's), update the
        text, apply the stop rules; True if the request is finished now. A stop token's
        own text is not added to the output. EOS, the stop token ids and the stop strings
        end the output only after its first min_tokens tokens (vLLM's rule: the workers
        hold the stop tokens back until then)."""
        # On the engine's step path for every request: plain attributes, no properties.
        if self.status is RequestStatus.FINISHED:
            raise RuntimeError(f"request {self.req_id!r} is finished; got token {token_id}")
        if now is None:
            now = time.monotonic()
        if self.logprobs is not None:
            self.logprobs.append(self._position_logprobs(token_id, logprobs, row))
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        params = self.sampling_params
        may_stop = len(self.output_token_ids) > params.min_tokens
        stop_token = may_stop and (
            (token_id in self.eos_token_ids and not params.ignore_eos)
            or token_id in params.stop_token_ids
        )
        out_of_length = (
            len(self.output_token_ids) >= params.max_tokens
            or len(self.all_token_ids) >= max_model_len
        )
        if self._detokenizer is not None:
            text = "" if stop_token else self._detokenizer.add(token_id)
            if stop_token or out_of_length:
                # The last text: bytes of an incomplete character come out as U+FFFD.
                text += self._detokenizer.flush()
            if self._append_text(text, may_stop):
                self.finish(FinishReason.STOP, now)
                return True
        if stop_token:
            self.stop_reason = token_id
            self.finish(FinishReason.STOP, now)
            return True
        if out_of_length:
            self.finish(FinishReason.LENGTH, now)
            return True
        return False

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now

    def take_delta(self) -> tuple[list[int], str]:
        """Output token ids and text not taken before. Until the request finishes, text
        that could still start a stop string is held back."""
        tokens = self.output_token_ids[self._tokens_taken :]
        self._tokens_taken = len(self.output_token_ids)
        end = len(self.output_text)
        if not self.is_finished:
            end = max(self._text_taken, end - self._holdback)
        text = self.output_text[self._text_taken : end]
        self._text_taken = end
        return tokens, text

    def timings(self) -> RequestTimings:
        """Timings so far; on an unfinished request total and tpot run up to now."""
        end = self.finish_time if self.finish_time is not None else time.monotonic()
        if self.first_token_time is None:
            return RequestTimings(ttft=0.0, tpot=0.0, total=end - self.arrival_time)
        num_after_first = len(self.output_token_ids) - 1
        tpot = (end - self.first_token_time) / num_after_first if num_after_first > 0 else 0.0
        return RequestTimings(
            ttft=self.first_token_time - self.arrival_time, tpot=tpot, total=end - self.arrival_time
        )

    def _position_logprobs(
        self, token_id: int, logprobs: LogprobsLists | None, row: int
    ) -> PositionLogprobs:
        """The row's sampled token (column 0) and its first n top tokens."""
        if logprobs is None:
            raise RuntimeError(
                f"request {self.req_id!r} asked for logprobs but the step returned none"
            )
        n = self.sampling_params.logprobs or 0
        ids = logprobs.logprob_token_ids[row, : n + 1].tolist()
        values = logprobs.logprobs[row, : n + 1].tolist()
        if len(ids) < n + 1 or ids[0] != token_id:
            raise RuntimeError(
                f"request {self.req_id!r}: the step's logprobs row {row} ({ids[:1]}, "
                f"{len(ids) - 1} top) does not hold token {token_id} and {n} top tokens"
            )
        texts = self._detokenizer.token_texts(ids) if self._detokenizer else [None] * len(ids)
        entries = [TokenLogprob(*entry) for entry in zip(ids, values, texts, strict=True)]
        rank = int(logprobs.sampled_token_ranks[row])
        return PositionLogprobs(sampled=entries[0], rank=rank, top=entries[1:])

    def _append_text(self, text: str, may_stop: bool) -> bool:
        """Append new output text; on a stop string (looked for when may_stop), trim the
        text there and return True."""
        if not text:
            return False
        start = len(self.output_text)
        self.output_text += text
        if not may_stop:
            return False
        hit: tuple[int, str] | None = None
        for stop in self.sampling_params.stop:
            # Only a match that ends in the new text is new.
            index = self.output_text.find(stop, max(0, start - len(stop) + 1))
            if index >= 0 and (hit is None or index < hit[0]):
                hit = (index, stop)
        if hit is None:
            return False
        self.output_text = self.output_text[: hit[0]]
        self.stop_reason = hit[1]
        return True
