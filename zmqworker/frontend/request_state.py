"""A request as its client follows it: the tokens the engine core sends, their text,
stop strings, logprobs with their texts, and timings.

The engine core ends a request on EOS, a stop token id, max_tokens or max_model_len; a
stop string is found here, in the text, and the request then ends here (the client
aborts it in the engine core). Streamed text stays behind by the longest stop string
less one character: those characters could still turn out to start one.

A request whose caller wants only its end (not streamed: LLM.generate) pays per step
only for what it uses: without stop strings its text is decoded once, as it ends, and
without logprobs either it is "bulk": the output processor appends its tokens itself,
outside apply(). One with detokenize=False (vLLM's) has no detokenizer at all: token ids
only, its text empty and its logprobs without token texts (new_requests.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from messages import FinishedOutput, FirstOutput, LogprobsLists, SamplingParams
from zmqworker.frontend.detokenizer import IncrementalDetokenizer
from zmqworker.frontend.outputs import (
    PositionLogprobs,
    RequestOutput,
    RequestTimings,
    TokenLogprob,
)


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        arrival_time: float | None = None,
        index: int = 0,
        shares_prompt_with: str | None = None,
        streamed: bool = True,
        prompt_logprobs_from: RequestState | None = None,
        extra_eos_token_ids: frozenset[int] = frozenset(),
        eos_token_id: int | None = None,
    ) -> None:
        """streamed: its caller takes every output (output() after each apply()); else
        only the last. prompt_logprobs_from: the sample whose prompt logprobs are this
        one's too (n > 1: only the first asks the engine core for them).
        extra_eos_token_ids: the end-of-sequence ids besides the tokenizer's (those the
        model's generation_config.json or config.json adds), which end the output as stop
        token ids do. eos_token_id: the tokenizer's, never a stop reason unless ignore_eos
        (vLLM checks it before stop_token_ids)."""
        if params.stop and detokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.index = index  # which of its prompt's n samples it is
        # The sibling sample whose prompt KV this one takes (n > 1), sent before it.
        self.shares_prompt_with = shares_prompt_with
        self.prompt_logprobs_from = prompt_logprobs_from
        self._extra_eos = extra_eos_token_ids
        self._eos = None if params.ignore_eos else eos_token_id
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.logprobs: list[PositionLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None  # with its first
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.since_last = 0.0  # the last output's interval from the one before
        self.queue_time = 0.0  # as the engine core measured it
        self.num_cached_tokens = 0  # prompt tokens its prefix cache held, as it said
        self.finish_time: float | None = None
        self._detokenizer = detokenizer
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._tokens_taken = 0
        self._text_taken = 0
        self.streamed = streamed
        # No text until it ends: nothing looks at it before (no stream, no stop strings).
        self._text_at_end = not streamed and not params.stop
        self._plain = self._text_at_end and params.logprobs is None
        # Its tokens may be appended in bulk (OutputProcessor): plain, and past its first.
        self.bulk = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def waits_for_prompt_logprobs(self) -> bool:
        """Its outputs wait (OutputProcessor holds them): its prompt logprobs are its
        first sample's, which come with that one's first output, not here yet."""
        first = self.prompt_logprobs_from
        return first is not None and first.prompt_logprobs is None and not first.finished

    def apply(
        self,
        new_token_ids: list[int],
        now: float,
        finished: FinishedOutput | None = None,
        first: FirstOutput | None = None,
        logprobs: LogprobsLists | None = None,
    ) -> bool:
        """Take a step's output of this request in: its new tokens, how it ended (if it
        did), its first output's report, its logprobs rows. True when it found a stop
        string (the request is finished here, and the engine core must be told)."""
        if first is not None:
            self.queue_time = first.queue_time_s
            if self.first_token_time is None:  # the prompt's engine core (disaggregated)
                self.num_cached_tokens = first.num_cached_tokens
        if new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            last, self.last_token_time = self.last_token_time, now
            self.since_last = 0.0 if last is None else now - last
        if self.logprobs is not None and new_token_ids:
            if logprobs is None or len(logprobs.logprob_token_ids) != len(new_token_ids):
                raise RuntimeError(
                    f"request {self.request_id!r} asked for logprobs; the engine core sent "
                    f"{0 if logprobs is None else len(logprobs.logprob_token_ids)} rows for "
                    f"{len(new_token_ids)} tokens"
                )
        if self._detokenizer is None or self._text_at_end:
            if self.logprobs is not None:
                self.logprobs += [self._position(logprobs, i) for i in range(len(new_token_ids))]
            self.output_token_ids += new_token_ids
            if finished is not None and self._detokenizer is not None:
                self.output_text = self._detokenizer.add_all(self._text_token_ids(finished))
        elif self._add_text(new_token_ids, finished, logprobs, now):
            return True
        if finished is not None:
            # vLLM's: the stop token id that ended the output, the extra EOS ids included
            # (vLLM makes them stop token ids), but None for the tokenizer's EOS, even
            # one listed in stop_token_ids.
            stop = finished.stop_reason
            listed = stop in self.params.stop_token_ids and stop != self._eos
            reported = listed or stop in self._extra_eos
            self.stop_reason = stop if reported else None
            self.finish(finished.finish_reason, now)
        self.bulk = self._plain and self.first_token_time is not None and not self.finished
        return False

    def _add_text(
        self,
        new_token_ids: list[int],
        finished: FinishedOutput | None,
        logprobs: LogprobsLists | None,
        now: float,
    ) -> bool:
        """Token by token, their text (and logprobs) as they come; True on a stop string
        (the request is finished here)."""
        assert self._detokenizer is not None
        last = len(new_token_ids) - 1
        for i, token in enumerate(new_token_ids):
            ending = i == last and finished is not None
            if self.logprobs is not None:
                self.logprobs.append(self._position(logprobs, i))
            self.output_token_ids.append(token)
            # A stop token's own text is not part of the output, unless asked for.
            stop_token = (
                ending
                and finished.stop_reason == token  # type: ignore[union-attr]
                and not self.params.include_stop_str_in_output
            )
            text = "" if stop_token else self._detokenizer.add(token)
            if ending:  # the last text: an incomplete character comes out as U+FFFD
                text += self._detokenizer.flush()
            # Like EOS and the stop ids, a stop string ends the output only after its
            # first min_tokens tokens.
            may_stop = len(self.output_token_ids) > self.params.min_tokens
            if self._append_text(text, may_stop):
                self.finish("stop", now)
                return True
        return False

    def _text_token_ids(self, finished: FinishedOutput) -> list[int]:
        """The output tokens whose text is the output's: a stop token's is not, unless
        asked for."""
        ids = self.output_token_ids
        if ids and finished.stop_reason == ids[-1] and not self.params.include_stop_str_in_output:
            return ids[:-1]
        return ids

    def finish(self, reason: str, now: float | None = None) -> None:
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now

    def output(self) -> RequestOutput:
        """The request's output now; what it adds is taken, so the next one starts
        after it."""
        new_tokens = self.output_token_ids[self._tokens_taken :]
        self._tokens_taken = len(self.output_token_ids)
        end = len(self.output_text)
        if not self.finished:
            end = max(self._text_taken, end - self._holdback)
        new_text = self.output_text[self._text_taken : end]
        self._text_taken = end
        first = self.prompt_logprobs_from  # n > 1: the one computation, the first's
        prompt_logprobs = self.prompt_logprobs if first is None else first.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            # Unfinished text stops where the streamed text does (stop-string holdback).
            text=self.output_text[:end],
            token_ids=list(self.output_token_ids),
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            timings=self.timings(),
            new_text=new_text,
            new_token_ids=new_tokens,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            index=self.index,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
        )

    def timings(self) -> RequestTimings:
        """Timings so far; on an unfinished request total and tpot run up to now."""
        end = self.finish_time if self.finish_time is not None else time.monotonic()
        if self.first_token_time is None:
            return RequestTimings(ttft=0.0, tpot=0.0, total=end - self.arrival_time)
        num_after_first = len(self.output_token_ids) - 1
        tpot = (end - self.first_token_time) / num_after_first if num_after_first > 0 else 0.0
        return RequestTimings(
            ttft=self.first_token_time - self.arrival_time,
            tpot=tpot,
            total=end - self.arrival_time,
            queue=self.queue_time,
            since_last=self.since_last,
        )

    def take_prompt_logprobs(self, rows: LogprobsLists) -> None:
        """Its prompt logprobs, a row per prompt position after the first (they come
        with its first output)."""
        count = len(rows.logprob_token_ids)
        if self.params.prompt_logprobs is None or count != len(self.prompt_token_ids) - 1:
            raise RuntimeError(
                f"request {self.request_id!r} of {len(self.prompt_token_ids)} prompt tokens "
                f"(prompt_logprobs={self.params.prompt_logprobs}): the engine core sent "
                f"{count} prompt logprobs rows"
            )
        self.prompt_logprobs = [None, *(self._position(rows, i) for i in range(count))]

    def _position(self, rows: LogprobsLists | None, i: int) -> PositionLogprobs:
        """Row i of the step's logprobs of this request: the sampled token, then the top
        ones."""
        assert rows is not None
        ids = rows.logprob_token_ids[i].tolist()
        values = rows.logprobs[i].tolist()
        detok = self._detokenizer
        texts = detok.token_texts(ids) if detok is not None else [None] * len(ids)
        entries = [TokenLogprob(*entry) for entry in zip(ids, values, texts, strict=True)]
        return PositionLogprobs(
            sampled=entries[0], rank=int(rows.sampled_token_ranks[i]), top=entries[1:]
        )

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
        for stop in self.params.stop:
            # Only a match that ends in the new text is new.
            index = self.output_text.find(stop, max(0, start - len(stop) + 1))
            if index >= 0 and (hit is None or index < hit[0]):
                hit = (index, stop)
        if hit is None:
            return False
        end = hit[0] + len(hit[1]) if self.params.include_stop_str_in_output else hit[0]
        self.output_text = self.output_text[:end]
        self.stop_reason = hit[1]
        return True
