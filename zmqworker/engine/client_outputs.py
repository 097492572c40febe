"""A step's outputs for one client, as the columns of EngineCoreOutputs: each request
that got tokens or ended once, its new tokens (all_token_ids from num_sent on) in one
int32 array, one token each in a decode step's common case (no offsets); how a request
ended, its first output's queue time and prompt logprobs, and its logprobs only for the
requests they concern."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from messages import (
    EngineCoreOutputs,
    EngineCoreStats,
    FinishedOutput,
    FirstOutput,
    RequestLogprobs,
    RequestPromptLogprobs,
)
from zmqworker.engine.request import FinishReason, Request, RequestStatus


def client_outputs(
    engine_index: int, requests: Iterable[Request], stats: EngineCoreStats
) -> EngineCoreOutputs:
    """The outputs of these requests (each once: no request twice), marking what they
    hand on as sent."""
    ids: list[str] = []
    tokens: list[int] = []
    counts: list[int] = []
    finished: list[FinishedOutput] = []
    first: list[FirstOutput] = []
    logprobs: list[RequestLogprobs] = []
    prompt_logprobs: list[RequestPromptLogprobs] = []
    one_each = True
    finished_status = RequestStatus.FINISHED
    for i, request in enumerate(requests):
        ids.append(request.req_id)
        all_ids, start = request.all_token_ids, request.num_sent
        end = len(all_ids)
        if end - start == 1:
            tokens.append(all_ids[-1])
        else:
            tokens += all_ids[start:end]
            one_each = False
        counts.append(end - start)
        request.num_sent = end
        if not request.first_output_sent:
            request.first_output_sent = True
            first.append(FirstOutput(i, request.num_cached_tokens, request.queue_time_s or 0.0))
            if request.prompt_logprobs is not None:
                prompt_logprobs.append(RequestPromptLogprobs(i, request.prompt_logprobs.take()))
        if request.status is finished_status:
            reason = request.finish_reason
            assert reason is not None and reason is not FinishReason.ABORT, reason
            finished.append(
                FinishedOutput(
                    i, reason.value, request.stop_reason, kv_transfer=request.kv_transfer_out
                )
            )
        if request.logprob_rows:
            rows = request.take_logprobs()
            assert rows is not None
            logprobs.append(RequestLogprobs(i, rows))
    offsets = None
    if not one_each:
        offsets = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
    return EngineCoreOutputs(
        engine_index,
        ids,
        np.array(tokens, np.int32),
        stats,
        token_offsets=offsets,
        finished=finished,
        first=first,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
