"""POST /v1/completions: text completion, whole or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from messages import SamplingParams
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, RequestOutput, json_logprob
from zmqworker.serve.best_of import best_of_params, keep_best
from zmqworker.serve.errors import APIError
from zmqworker.serve.generation import (
    finish_reason,
    max_tokens_for,
    now,
    prompt_logprobs,
    run_prompts,
    sampling_params,
    sse,
    until_disconnected,
    usage,
)
from zmqworker.serve.protocol import CompletionRequest
from zmqworker.serve.request_id import request_id
from zmqworker.serve.text_pool import TextPool


async def create_completion(
    llm: Frontend, model: str, body: CompletionRequest, http: HTTPRequest, text: TextPool
) -> JSONResponse | StreamingResponse:
    prompts, echoes = await text.run(_encode, llm, body)
    each = prompt_params(llm, body, prompts)
    params = each[0]
    head = {
        "id": f"cmpl-{request_id(http)}",
        "object": "text_completion",
        "created": now(),
        "model": model,
    }
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(llm, prompts, each, head, echoes, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    best_of = body.best_of or params.n  # above n: the n best (a stream was refused)
    run = [best_of_params(p, best_of) for p in each] if best_of > params.n else each
    finals = await until_disconnected(http, _collect(llm, prompts, run))
    if best_of > params.n:
        finals = keep_best(finals, best_of, params)
    choices = [
        {
            "index": i,
            "text": echoes[i // params.n] + out.text,
            "logprobs": _logprobs(out.logprobs) if out.logprobs is not None else None,
            "finish_reason": finish_reason(out),
            "stop_reason": out.stop_reason,
            "prompt_logprobs": prompt_logprobs(out),
        }
        for i, out in enumerate(finals)
    ]
    return JSONResponse({**head, "choices": choices, "usage": usage(finals)})


def prompt_params(
    llm: Frontend, body: CompletionRequest, prompts: list[list[int]]
) -> list[SamplingParams]:
    """Each prompt's sampling params: the request's, checked against the longest prompt,
    with max_tokens each prompt's own (max_tokens_for: the room its length leaves, where
    the request sets none, as vLLM's)."""
    params = sampling_params(
        llm, body, max(len(p) for p in prompts), body.max_tokens, body.logprobs
    )
    return [
        msgspec.structs.replace(params, max_tokens=max_tokens_for(llm, len(p), body.max_tokens))
        for p in prompts
    ]


async def _collect(
    llm: Frontend, prompts: list[list[int]], params: list[SamplingParams]
) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, out in run_prompts(llm, prompts, params):
        finals[index] = out
    return [finals[i] for i in range(len(prompts) * params[0].n)]


async def _stream(
    llm: Frontend,
    prompts: list[list[int]],
    params: list[SamplingParams],
    head: dict[str, Any],
    echoes: list[str],
    include_usage: bool,
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    n = params[0].n
    num_choices = len(prompts) * n
    unechoed = set(range(num_choices))
    sent = [0] * num_choices  # positions whose logprobs were sent, per choice
    offset = [0] * num_choices  # the characters of their tokens' texts
    try:
        async for index, out in run_prompts(llm, prompts, params):
            text = out.new_text
            if index in unechoed:
                text = echoes[index // n] + text
                unechoed.discard(index)
            logprobs = None
            if out.logprobs is not None:
                logprobs = _logprobs(out.logprobs[sent[index] :], offset[index])
                sent[index] = len(out.logprobs)
                offset[index] += sum(map(len, logprobs["tokens"]))
            if out.finished:
                finals[index] = out
            if text or out.finished or logprobs:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(out),
                    "stop_reason": out.stop_reason if out.finished else None,
                }
                yield sse({**head, "choices": [choice]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(finals.values()))})
    except Exception as exc:  # tell the client, then end the stream
        yield sse(APIError.of(exc).body())
    yield sse("[DONE]")


def _encode(llm: Frontend, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids, checked against the model, and the text echo puts before
    each completion (text work: in the text pool)."""
    prompts, echoes = [], []
    for name, prompt in body.named_prompts():
        try:
            token_ids = llm.encode(prompt)
        except ValueError as exc:
            raise APIError.from_value_error(exc, param=name) from None
        prompts.append(token_ids)
        echoes.append(_echo(llm, prompt, token_ids) if body.echo else "")
    return prompts, echoes


def _echo(llm: Frontend, prompt: str | list[int], token_ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return llm.tokenizer.decode(token_ids) if llm.tokenizer is not None else ""


def _logprobs(positions: list[PositionLogprobs], at: int = 0) -> dict[str, Any]:
    """The legacy completions format: parallel lists, and text offsets (the first token's
    at: in a stream, the characters of the tokens sent before)."""
    tokens = [p.sampled.text or "" for p in positions]
    offsets = []
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(p.sampled.logprob) for p in positions],
        "top_logprobs": [_top(p) for p in positions],
        "text_offset": offsets,
    }


def _top(position: PositionLogprobs) -> dict[str, float]:
    """The legacy format's top_logprobs entry: the sampled token first, then the top n
    (so n + 1 entries where it is not among them), as OpenAI's and vLLM's."""
    entry = {position.sampled.text or "": json_logprob(position.sampled.logprob)}
    for token in position.top:
        entry.setdefault(token.text or "", json_logprob(token.logprob))
    return entry
