"""POST /v1/chat/completions: the model's chat template over the messages (system role
included), the reply whole or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, RequestOutput, TokenLogprob
from zmqworker.serve.errors import APIError
from zmqworker.serve.generation import (
    finish_reason,
    now,
    run_prompts,
    sampling_params,
    sse,
    until_disconnected,
    usage,
)
from zmqworker.serve.protocol import ChatCompletionRequest
from zmqworker.serve.request_id import request_id
from zmqworker.serve.text_pool import TextPool


async def create_chat_completion(
    llm: Frontend, model: str, body: ChatCompletionRequest, http: HTTPRequest, text: TextPool
) -> JSONResponse | StreamingResponse:
    prompt = await text.run(_prompt, llm, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(llm, body, len(prompt), max_tokens, body.num_logprobs())
    head = {"id": f"chatcmpl-{request_id(http)}", "created": now(), "model": model}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            _stream(llm, prompt, params, head, include_usage), media_type="text/event-stream"
        )
    out = await until_disconnected(http, _final(llm, prompt, params))
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": _logprobs(out.logprobs) if out.logprobs is not None else None,
        "finish_reason": finish_reason(out),
        "stop_reason": out.stop_reason,
    }
    return JSONResponse(
        {**head, "object": "chat.completion", "choices": [choice], "usage": usage([out])}
    )


def _prompt(llm: Frontend, body: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids through the chat template, checked against the model
    (text work: in the text pool)."""
    try:
        return llm.encode(llm.chat_prompt([m.as_template_message() for m in body.messages]))
    except ValueError as exc:
        raise APIError.from_value_error(exc, param="messages") from None


async def _final(llm: Frontend, prompt: list[int], params: Any) -> RequestOutput:
    last = None
    async for _, out in run_prompts(llm, [prompt], params):
        last = out
    assert last is not None
    return last


async def _stream(
    llm: Frontend, prompt: list[int], params: Any, head: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], **choice: Any) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, **choice}]})

    yield chunk({"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)
    sent = 0
    try:
        async for _, out in run_prompts(llm, [prompt], params):
            logprobs = None
            if out.logprobs is not None:
                logprobs = _logprobs(out.logprobs[sent:])
                sent = len(out.logprobs)
            if out.new_text or logprobs:
                yield chunk({"content": out.new_text}, logprobs=logprobs, finish_reason=None)
            if out.finished:
                yield chunk(
                    {}, logprobs=None, finish_reason=finish_reason(out), stop_reason=out.stop_reason
                )
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage([out])})
    except Exception as exc:  # the engine failed: tell the client, then end the stream
        yield sse(APIError(f"{type(exc).__name__}: {exc}", 500, "server_error").body())
    yield sse("[DONE]")


def _logprobs(positions: list[PositionLogprobs]) -> dict[str, Any]:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top tokens."""

    def entry(token: TokenLogprob) -> dict[str, Any]:
        text = token.text or ""
        return {"token": text, "logprob": token.logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(p.sampled), "top_logprobs": [entry(t) for t in p.top]} for p in positions
        ]
    }
