"""What both endpoints share: sampling parameters from a request, running its prompts as
one stream of outputs, usage, server-sent events and cancellation on disconnect."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import msgspec
from starlette.requests import Request as HTTPRequest

from messages import SamplingParams
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import RequestOutput, json_logprob
from zmqworker.frontend.request_params import max_tokens_for, request_params
from zmqworker.serve.errors import APIError
from zmqworker.serve.protocol import SamplingRequest


def sampling_params(
    llm: Frontend,
    request: SamplingRequest,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str = "logprobs",
) -> SamplingParams:
    """The model's defaults with what the request sets; max_tokens as max_tokens_for
    (frontend/request_params.py) says, bounded by the model's max_new_tokens. A prompt
    and max_tokens past max_model_len are refused, as OpenAI does; so are logprobs past
    the server's --max-logprobs (logprobs_param: the request's name for them, chat's
    top_logprobs)."""
    room = llm.max_model_len - prompt_len
    asked = 1 if max_tokens is None else max_tokens  # a completion is a token at least
    if asked > room:
        raise APIError(
            f"This model's maximum context length is {llm.max_model_len} tokens. However, "
            f"you requested {prompt_len + asked} tokens ({prompt_len} in the prompt, "
            f"{asked} in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens" if room >= 1 else "prompt",
        )
    max_tokens = max_tokens_for(llm.max_model_len, prompt_len, max_tokens, llm.max_new_tokens)
    given = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "stop": request.stop_strings(),
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": request.token_bias(),
        "min_tokens": request.min_tokens,
        "bad_words": request.bad_words,
        "allowed_token_ids": request.allowed_token_ids,
        "logprobs": logprobs,
        "prompt_logprobs": request.engine_prompt_logprobs(),
        "max_tokens": max_tokens,
        "n": request.n,
        "structured_outputs": request.structured_params(),
    }
    try:
        params = msgspec.structs.replace(
            llm.default_sampling_params(), **{k: v for k, v in given.items() if v is not None}
        )
        # Checked here, before a response starts: the vocabulary, the bad words' tokens.
        return request_params(params, llm.tokenizer, llm.vocab_size, llm.max_logprobs)
    except ValueError as exc:
        named = re.match(r"\w+", str(exc))
        field = named.group() if named and named.group() in given else None
        if field == "structured_outputs":
            field = request.structured_field()
        elif field == "logprobs" and logprobs_param != field:
            exc = ValueError(logprobs_param + str(exc).removeprefix(field))
            field = logprobs_param
        raise APIError.from_value_error(exc, param=field) from None


async def run_prompts(
    llm: Frontend, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's outputs (prompt i with params[i], all of one n) as they come, tagged
    with their choice's index: prompt i's sample j is choice i * n + j, as vLLM numbers
    them. Closing this early (a client gone) aborts the requests still running, which
    frees their blocks."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, prompt: list[int], each: SamplingParams) -> None:
        try:
            async for out in llm.generate_stream(prompt, each):
                queue.put_nowait((index * each.n + out.index, out))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [
        asyncio.create_task(pump(i, p, each))
        for i, (p, each) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (answered with 499)."""


async def until_disconnected(request: HTTPRequest, work: Awaitable[Any]) -> Any:
    """work's result; if the client disconnects first, work is cancelled (and with it its
    requests in the engine) and ClientDisconnected raised."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, listener], return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected
    return task.result()


async def _disconnect(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(outputs: Sequence[RequestOutput], generated: bool = True) -> dict[str, Any]:
    """Every choice's tokens, and each prompt's once (its first sample's), as vLLM sums;
    of the prompts' tokens, those the prefix cache held (OpenAI's cached_tokens).
    generated=False: none of the generated tokens is returned (an echo of max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o.index == 0)
    cached = sum(o.num_cached_tokens for o in outputs if o.index == 0)
    completion = sum(len(o.token_ids) for o in outputs) if generated else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chunk_usage(out: RequestOutput, generated: bool = True) -> dict[str, int]:
    """A streamed chunk's usage (vLLM's continuous_usage_stats): its prompt, and its
    choice's tokens so far."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids) if generated else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def prompt_logprobs(out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt position None for the first, then by token id
    the prompt's token and the top ones, each with its logprob, rank and text."""
    if out.prompt_logprobs is None:
        return None
    positions: list[dict[str, Any] | None] = [None]
    for entry in out.prompt_logprobs[1:]:
        assert entry is not None
        ranked = [(entry.sampled, entry.rank), *((t, r) for r, t in enumerate(entry.top, 1))]
        tokens: dict[str, Any] = {}
        for token, rank in ranked:
            tokens.setdefault(
                str(token.token_id),
                {"logprob": json_logprob(token.logprob), "rank": rank, "decoded_token": token.text},
            )
        positions.append(tokens)
    return positions


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish reasons: an aborted request (the server stopping) ends as "stop"."""
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def now() -> int:
    return int(time.time())


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
