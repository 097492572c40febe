"""best_of > n on /v1/completions (vLLM v0's): each prompt's best_of samples run as n > 1
samples do, sharing its KV, with their tokens' logprobs; the n of the highest cumulative
logprob (the sum of their tokens' logprobs, raw as `logprobs` gives them) are returned,
most likely first, without the logprobs unless the request asked for them."""

from __future__ import annotations

import dataclasses

import msgspec

from messages import SamplingParams
from zmqworker.frontend.outputs import RequestOutput


def best_of_params(params: SamplingParams, best_of: int) -> SamplingParams:
    """What runs: best_of samples, each with its tokens' logprobs (at least their own)."""
    logprobs = 0 if params.logprobs is None else params.logprobs
    return msgspec.structs.replace(params, n=best_of, logprobs=logprobs)


def cumulative_logprob(out: RequestOutput) -> float:
    assert out.logprobs is not None
    return sum(position.sampled.logprob for position in out.logprobs)


def keep_best(
    finals: list[RequestOutput], best_of: int, params: SamplingParams
) -> list[RequestOutput]:
    """Of each prompt's best_of outputs (choices prompt * best_of + i), its params.n of the
    highest cumulative logprob, numbered 0..n-1 in that order (ties: the lower index)."""
    kept = []
    for start in range(0, len(finals), best_of):
        group = finals[start : start + best_of]
        ranked = sorted(group, key=cumulative_logprob, reverse=True)[: params.n]
        # The prompt's cache hits are its first sample's: the others share its blocks.
        cached = group[0].num_cached_tokens
        for index, out in enumerate(ranked):
            logprobs = out.logprobs if params.logprobs is not None else None
            kept.append(
                dataclasses.replace(out, index=index, logprobs=logprobs, num_cached_tokens=cached)
            )
    return kept
