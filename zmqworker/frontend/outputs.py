"""What the LLM API returns for a request, and the engines' stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from messages import EngineCoreStats

# A token that a grammar, a bad word or min_tokens rules out has a logprob of -inf, which
# JSON cannot hold: OpenAI and vLLM write this floor instead.
MIN_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """logprob as a JSON number: at least MIN_LOGPROB (NaN too)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log probability; text is the token decoded alone (None when the
    model has no tokenizer, or the request has detokenize=False)."""

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
    """Seconds, as the client saw them: time to first token, mean time per output token
    after the first, and arrival to finish; as its engine core saw it, queue: from taking
    the request in to first scheduling it (0 until its first output). since_last: from
    the request's previous output to this one (0 on its first), the inter-token latency
    of a step."""

    ttft: float
    tpot: float
    total: float
    queue: float = 0.0
    since_last: float = 0.0


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput: one sample's result, as RequestOutput.outputs shows it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestOutput:
    """A request's output so far. text and token_ids are everything generated; new_text
    and new_token_ids what this output adds to the previous one of the same request
    (streaming). finish_reason is "stop", "length" or "abort" once finished; stop_reason,
    as vLLM's, the stop string or stop token id that ended it (generation_config's extra
    end-of-sequence ids count as stop tokens; None for the tokenizer's EOS). logprobs
    (when SamplingParams.logprobs asked for them) has one entry per token of token_ids:
    the last len(new_token_ids) are the new ones. prompt_logprobs (when
    SamplingParams.prompt_logprobs asked for them, from the first output on): one entry
    per prompt token, None for the first, then the prompt's token as `sampled` with its
    rank, and the top ones. index: which of its prompt's n samples (SamplingParams.n) it
    is. num_cached_tokens (from the first output on): the prompt tokens its engine core
    did not compute for it when it first scheduled it: prefix-cache hits, and for a sample
    after its prompt's first the prompt blocks it shares with that one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    timings: RequestTimings
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    index: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    # vLLM's shape, as a view: out.outputs[0].text is out.text. A request here is one
    # sample: n samples are n RequestOutputs (index), not one with n outputs.

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs when logprobs were asked for, else None."""
        if self.logprobs is None:
            return None
        return sum(position.sampled.logprob for position in self.logprobs)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's RequestOutput.outputs: this sample alone."""
        return [
            CompletionOutput(
                self.index,
                self.text,
                self.token_ids,
                self.cumulative_logprob,
                self.logprobs,
                self.finish_reason,
                self.stop_reason,
            )
        ]


class EngineStats(msgspec.Struct, frozen=True):
    """What the engine cores hold now, added up over the data-parallel replicas
    (LLM.stats(); per_engine: each replica's own)."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int  # since start
    num_aborted: int  # requests whose client gave up on them before they finished
    # Tokens whose KV prefills computed, since start (prefix-cache hits and the prompt
    # blocks n > 1 samples share are not computed again)
    num_prefill_tokens: int = 0
    # The host KV tier (EngineCoreStats says what each is)
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0
    num_host_stored_blocks: int = 0
    num_host_loaded_blocks: int = 0
    num_host_dropped_blocks: int = 0
    # A disaggregated decode side's prompt blocks reused and pulled (EngineCoreStats)
    num_remote_hit_blocks: int = 0
    num_remote_pulled_blocks: int = 0
    per_engine: list[EngineCoreStats] = []

    @classmethod
    def total(cls, engines: Sequence[EngineCoreStats]) -> EngineStats:
        fields = [name for name in cls.__struct_fields__ if name != "per_engine"]
        sums = {name: sum(getattr(e, name) for e in engines) for name in fields}
        return cls(**sums, per_engine=list(engines))
