"""A request's life in the engine core: its tokens, status and the stop rules that need
no text (EOS and stop token ids, max_tokens, max_model_len). Text, stop strings and
timings are the client's (zmqworker/frontend/request_state.py)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from messages import LogprobsLists, RemoteKV, SamplingParams
from zmqworker.engine.prompt_logprobs import PromptLogprobRows


@dataclass(frozen=True)
class RemotePrefill:
    """A decode instance's request whose prompt another instance prefilled: where that
    KV waits, and the first token the prefill sampled (this request's first output)."""

    kv: RemoteKV
    first_token: int


if TYPE_CHECKING:
    from zmqworker.engine.request_grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not scheduled yet, or preempted and waiting to start over
    # Its prompt was prefilled by another instance, whose KV it waits for (outside the
    # waiting queue: engine/kv_connector.py).
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens, or the model's max_model_len
    ABORT = "abort"
    # Not run: too little of its prompt was cached for its max_uncached_tokens.
    DECLINED = "declined"


class Request:
    """One generation request. The scheduler moves it between states; append_output_token
    applies the stop rules to each sampled token; what is new goes to the client in
    its step's columns (client_outputs.py), from num_sent on.

    all_token_ids is the prompt followed by the outputs. What the scheduler counts of a
    running request (tokens computed, steps in flight) is its own (running.py, in_flight.py).

    Disaggregated serving: remote_decode (a prefill instance's request) finishes after
    its first token with its KV kept for a decode instance (kv_transfer_out says where);
    remote (a decode instance's) starts from that KV and that first token.
    max_uncached_tokens (a decode instance's, its prompt computed there): it runs only if
    at most that many of its prompt's tokens are uncached when first scheduled (declines).
    error: why the request could not go on: its remote KV never came (finish_reason
    abort), or too little of its prompt was cached (declined).
    """

    # Slots: the engine core reads a few of these of every running request each step.
    __slots__ = (
        "all_token_ids", "arrival_time", "eos_token_ids", "eos_token_list", "error",
        "finish_reason", "first_output_sent", "grammar", "handle", "kv_transfer_out",
        "logprob_rows", "max_uncached_tokens", "num_cached_tokens", "num_loaded_tokens",
        "num_preemptions", "num_prompt_tokens", "num_sent", "prompt_logprobs", "prompt_token_ids",
        "queue_time_s", "queued_at", "remote", "remote_decode", "req_id", "sampling_params",
        "shares_prompt_with", "status", "stop_reason", "stop_token_ids",
    )  # fmt: skip

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        shares_prompt_with: str | None = None,
        remote_decode: bool = False,
        remote: RemotePrefill | None = None,
        max_uncached_tokens: int | None = None,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        if sampling_params.n != 1:
            raise ValueError(
                f"request {req_id!r}: n={sampling_params.n}; the engine core runs one sample "
                "per request (the client fans n out into requests that share the prompt)"
            )
        if remote is not None and sampling_params.prompt_logprobs is not None:
            raise ValueError(
                f"request {req_id!r}: prompt_logprobs with a remote prefill, which computes "
                "its prompt elsewhere"
            )
        if (remote_decode, remote is not None, max_uncached_tokens is not None).count(True) > 1:
            raise ValueError(
                f"request {req_id!r}: give at most one of remote_decode, a remote prefill "
                "and max_uncached_tokens"
            )
        if max_uncached_tokens is not None and max_uncached_tokens < 1:
            raise ValueError(
                f"request {req_id!r}: max_uncached_tokens must be >= 1, got {max_uncached_tokens}"
            )
        if remote is not None and remote.kv.num_tokens != len(prompt_token_ids):
            raise ValueError(
                f"request {req_id!r}: the remote KV holds {remote.kv.num_tokens} tokens, "
                f"the prompt has {len(prompt_token_ids)}"
            )
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
        self.queued_at = time.monotonic()  # taken in by the engine core
        self.queue_time_s: float | None = None  # queued_at to first scheduled
        # A sibling (same prompt, n > 1) whose prompt blocks this one takes once computed.
        self.shares_prompt_with = shares_prompt_with
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None  # the stop token id hit
        self.handle: int | None = None  # set while the workers hold it
        self.num_cached_tokens = 0  # prefix-cache hits when it was first scheduled
        self.num_preemptions = 0
        # The logprobs rows of the tokens not sent yet (take_logprobs), when asked for:
        # (top ids, their logprobs, the sampled token's rank) each.
        self.logprob_rows: list[tuple[np.ndarray, np.ndarray, int]] | None = (
            None if sampling_params.logprobs is None else []
        )
        # Its prompt logprobs (when asked for), held until its first output.
        self.prompt_logprobs: PromptLogprobRows | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobRows(req_id, sampling_params.prompt_logprobs)
        # all_token_ids[:num_sent] are the prompt and the outputs its client has.
        self.num_sent = self.num_prompt_tokens
        self.first_output_sent = False  # its first output reports its queue time
        self.remote_decode = remote_decode
        self.remote = remote
        self.max_uncached_tokens = max_uncached_tokens
        self.kv_transfer_out: RemoteKV | None = None
        self.error: str | None = None
        # Tokens a remote prefill's KV, loaded into its blocks, holds: the scheduler starts
        # it from there (and counts them itself from then on: running.py).
        self.num_loaded_tokens = 0
        if remote is not None:
            # The prefill's token: an output already given to the client.
            self.all_token_ids.append(remote.first_token)
            self.num_sent += 1
            self.first_output_sent = True
        # Its structured_outputs' matcher, once its grammar is compiled (None without).
        self.grammar: RequestGrammar | None = None

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
            f"outputs={len(self.all_token_ids) - self.num_prompt_tokens})"
        )

    def declines(self, num_cached: int) -> str | None:
        """Why, first to be scheduled with num_cached of its tokens cached, it is not to run
        here: more than its max_uncached_tokens are not (None: it runs; a restart, whose
        outputs the client has, always runs)."""
        limit = self.max_uncached_tokens
        uncached = self.num_tokens - num_cached
        if limit is None or self.num_preemptions or uncached <= limit:
            return None
        where = "not cached here"
        if self.sampling_params.prompt_logprobs is not None:
            where = "to compute here (it asks for prompt logprobs: every position)"
        return (
            f"request {self.req_id!r}: {uncached} of its {self.num_tokens} prompt tokens are "
            f"{where}, more than max_uncached_tokens={limit}; it was not run"
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
        the stop tokens back until then). A structured request's grammar takes the tokens
        it lacks when the token may end it (one of the grammar's stop tokens): its end
        stops the request too, a token it refuses aborts it (with error); its other
        tokens reach it in batches (RequestGrammar).
        The scheduler appends most tokens itself, in bulk, and calls this only where
        stop_token_ids (with the grammar's) or length_limit say it may finish, or the
        request needs a look of its own (logprobs, a remote decode)."""
        if self.status is RequestStatus.FINISHED:
            raise RuntimeError(f"request {self.req_id!r} is finished; got token {token_id}")
        if self.logprob_rows is not None:
            self.logprob_rows.append(self._logprob_row(token_id, logprobs, row))
        self.all_token_ids.append(token_id)
        params = self.sampling_params
        grammar = self.grammar
        ends_grammar = grammar is not None and token_id in grammar.stop_token_ids
        if ends_grammar and (refused := grammar.catch_up(self.req_id, self.all_token_ids)):
            self.error = refused  # its client alone gets the failure
            self.finish(FinishReason.ABORT)
            return True
        num_outputs = len(self.all_token_ids) - self.num_prompt_tokens
        if num_outputs > params.min_tokens and token_id in self.stop_token_ids:
            self.stop_reason = token_id
            self.finish(FinishReason.STOP)
            return True
        if ends_grammar and grammar.terminated:
            self.finish(FinishReason.STOP)
            return True
        if len(self.all_token_ids) >= self.length_limit(max_model_len):
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def length_limit(self, max_model_len: int) -> int:
        """The number of tokens (prompt and outputs) at which it ends by length."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, max_model_len)

    def start_running(self, num_hit: int) -> None:
        """The scheduler takes it from the waiting queue, num_hit of its tokens' KV held
        already; the first time ends its queue time and says its cache hits (on a resume
        after a preemption, its own blocks would count)."""
        self.status = RequestStatus.RUNNING
        if self.queue_time_s is None:
            self.queue_time_s = time.monotonic() - self.queued_at
            self.num_cached_tokens = num_hit

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def take_logprobs(self) -> LogprobsLists | None:
        """The logprobs rows of the tokens not sent yet (None: none, or not asked for)."""
        if not self.logprob_rows:
            return None
        ids, values, ranks = zip(*self.logprob_rows, strict=True)
        self.logprob_rows = []
        return LogprobsLists(np.stack(ids), np.stack(values), np.array(ranks, np.int32))

    def take_routed_logprobs(self) -> tuple[LogprobsLists | None, LogprobsLists | None]:
        """What an in-process router hands on after a step, where client_outputs.py would
        send it: (the logprobs rows of the tokens not sent yet, its prompt logprobs with
        its first output), each None where there are none or none were asked for."""
        prompt = None
        if self.output_token_ids and not self.first_output_sent:
            self.first_output_sent = True
            if self.prompt_logprobs is not None:
                prompt = self.prompt_logprobs.take()
        return self.take_logprobs(), prompt

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
