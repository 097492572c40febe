"""What the LLM API returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from zmqworker.engine.request import (
    PositionLogprobs,
    Request,
    RequestTimings,
    TokenLogprob,
)

__all__ = ["EngineStats", "PositionLogprobs", "RequestOutput", "RequestTimings", "TokenLogprob"]


@dataclass
class RequestOutput:
    """A request's output so far. text and token_ids are everything generated; new_text
    and new_token_ids what this output adds to the previous one of the same request
    (streaming). finish_reason is "stop", "length" or "abort" once finished. logprobs
    (when SamplingParams.logprobs asked for them) has one entry per token of token_ids:
    the last len(new_token_ids) are the new ones."""

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

    @classmethod
    def from_request(cls, request: Request, prompt: str | None) -> RequestOutput:
        """The request's state now; takes its delta, so the next one starts after it."""
        new_token_ids, new_text = request.take_delta()
        finished = request.is_finished
        return cls(
            request_id=request.req_id,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            # Unfinished text stops where the streamed text does (stop-string holdback).
            text=request.output_text if finished else request.output_text[: request.text_taken],
            token_ids=list(request.output_token_ids),
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            timings=request.timings(),
            new_text=new_text,
            new_token_ids=new_token_ids,
            logprobs=None if request.logprobs is None else list(request.logprobs),
        )


class EngineStats(msgspec.Struct, frozen=True):
    """What the engine holds now (LLM.stats())."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int  # since start
    num_aborted: int  # streams closed before their request finished, since start
