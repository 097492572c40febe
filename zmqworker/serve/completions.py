"""POST /v1/completions: text completion, whole or streamed as server-sent events. With
echo, each choice starts with its prompt and, with logprobs, the prompt's positions come
first in them (vLLM's: the first with null logprob and top_logprobs); echo with
max_tokens 0 returns the prompt alone (lm-eval-harness's loglikelihood)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from messages import SamplingParams
from zmqworker.engine.prompts import check_text, kept_tokens
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, RequestOutput, json_logprob
from zmqworker.frontend.request_params import max_tokens_for
from zmqworker.serve.best_of import best_of_params, keep_best
from zmqworker.serve.errors import APIError
from zmqworker.serve.generation import (
    chunk_usage,
    finish_reason,
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


@dataclass(frozen=True)
class _Echo:
    """What echo puts before a prompt's completions: its text, and the text of its first
    token alone (the one prompt position without logprobs)."""

    text: str = ""
    first: str = ""


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
        events = _stream(llm, prompts, each, head, echoes, body)
        return StreamingResponse(events, media_type="text/event-stream")
    best_of = body.best_of or params.n  # above n: the n best (a stream was refused)
    run = [best_of_params(p, best_of) for p in each] if best_of > params.n else each
    finals = await until_disconnected(http, _collect(llm, prompts, run))
    if best_of > params.n:
        finals = keep_best(finals, best_of, params)
    generated = not body.echo_only()
    choices = []
    for i, out in enumerate(finals):
        echo = echoes[i // params.n]
        choices.append(
            {
                "index": i,
                "text": echo.text + (out.text if generated else ""),
                "logprobs": _choice_logprobs(body, out, echo if body.echo else None, 0, 0),
                "finish_reason": finish_reason(out),
                "stop_reason": out.stop_reason,
                "prompt_logprobs": prompt_logprobs(out),
            }
        )
    return JSONResponse({**head, "choices": choices, "usage": usage(finals, generated)})


def prompt_params(
    llm: Frontend, body: CompletionRequest, prompts: list[list[int]]
) -> list[SamplingParams]:
    """Each prompt's sampling params: the request's, checked against the longest prompt,
    with max_tokens each prompt's own (max_tokens_for: the room its length leaves, where
    the request sets none, as vLLM's)."""
    max_tokens = body.engine_max_tokens()
    params = sampling_params(llm, body, max(len(p) for p in prompts), max_tokens, body.logprobs)
    bound = llm.max_new_tokens
    return [
        msgspec.structs.replace(
            params, max_tokens=max_tokens_for(llm.max_model_len, len(p), max_tokens, bound)
        )
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
    echoes: list[_Echo],
    body: CompletionRequest,
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    n = params[0].n
    num_choices = len(prompts) * n
    include_usage, continuous = body.stream_usage()
    generated = not body.echo_only()
    unechoed = set(range(num_choices)) if body.echo else set()
    sent = [0] * num_choices  # positions whose logprobs were sent, per choice
    offset = [0] * num_choices  # the characters of their tokens' texts
    try:
        async for index, out in run_prompts(llm, prompts, params):
            text = out.new_text if generated else ""
            echo = None
            if index in unechoed:
                echo = echoes[index // n]
                text = echo.text + text
                unechoed.discard(index)
            logprobs = _choice_logprobs(body, out, echo, sent[index], offset[index])
            if logprobs is not None:
                sent[index] = len(out.logprobs or [])
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
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = chunk_usage(out, generated)
                yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(list(finals.values()), generated)})
    except Exception as exc:  # tell the client, then end the stream
        yield sse(APIError.of(exc).body())
    yield sse("[DONE]")


def _encode(llm: Frontend, body: CompletionRequest) -> tuple[list[list[int]], list[_Echo]]:
    """The prompts' token ids, checked against the model, and what echo puts before each
    completion (text work: in the text pool)."""
    prompts, echoes = [], []
    special = body.with_special_tokens()
    try:
        keep = kept_tokens(body.truncate_prompt_tokens, llm.max_model_len)
    except ValueError as exc:
        raise APIError.from_value_error(exc, param="truncate_prompt_tokens") from None
    for name, prompt in body.named_prompts():
        try:
            token_ids = llm.encode(_tokenized(llm, prompt, special), keep)
        except ValueError as exc:
            raise APIError.from_value_error(exc, param=name) from None
        prompts.append(token_ids)
        echoes.append(_echo(llm, body, prompt, token_ids) if body.echo else _Echo())
    return prompts, echoes


def _tokenized(llm: Frontend, prompt: str | list[int], special: bool) -> str | list[int]:
    """The prompt as llm.encode takes it: a text without the tokenizer's special tokens
    (add_special_tokens false: no BOS) is tokenized here."""
    if special or not isinstance(prompt, str) or llm.tokenizer is None:
        return prompt
    check_text(prompt, "the prompt")
    return list(llm.tokenizer.encode(prompt, add_special_tokens=False))


def _echo(llm: Frontend, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> _Echo:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        return _Echo(prompt if isinstance(prompt, str) else "")
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    return _Echo(text, tokenizer.decode(ids[:1]) if body.logprobs is not None else "")


def _choice_logprobs(
    body: CompletionRequest, out: RequestOutput, echo: _Echo | None, start: int, at: int
) -> dict[str, Any] | None:
    """A choice's logprobs (or a chunk's: its generated positions from start, the first's
    text at offset at), after the prompt's positions when echo is given; None when the
    request asked for none."""
    if body.logprobs is None:
        return None
    positions: list[PositionLogprobs | None] = []
    if echo is not None:
        positions += out.prompt_logprobs or []
    if not body.echo_only():
        positions += (out.logprobs or [])[start:]
    return _logprobs(positions, at, echo.first if echo is not None else "", body.logprobs)


def _logprobs(
    positions: Sequence[PositionLogprobs | None], at: int = 0, first: str = "", n: int | None = None
) -> dict[str, Any]:
    """The legacy completions format: parallel lists, and text offsets (the first token's
    at: in a stream, the characters of the tokens sent before). A None position is the
    prompt's first (text first), which has no logprob; each top_logprobs entry holds the
    sampled token and at most n others."""
    tokens = [first if p is None else p.sampled.text or "" for p in positions]
    offsets = []
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if p is None else json_logprob(p.sampled.logprob) for p in positions
        ],
        "top_logprobs": [None if p is None else _top(p, n) for p in positions],
        "text_offset": offsets,
    }


def _top(position: PositionLogprobs, n: int | None = None) -> dict[str, float]:
    """The legacy format's top_logprobs entry: the sampled token first, then the top n
    (so n + 1 entries where it is not among them), as OpenAI's and vLLM's."""
    entry = {position.sampled.text or "": json_logprob(position.sampled.logprob)}
    for token in position.top[:n]:
        entry.setdefault(token.text or "", json_logprob(token.logprob))
    return entry
