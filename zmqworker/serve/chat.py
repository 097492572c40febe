"""POST /v1/chat/completions: the model's chat template over the messages (system role
included) and the request's tools, the reply whole or streamed as server-sent events, its
tool calls read out of it when tool_choice asks for them (serve/tools.py)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from zmqworker.engine.prompts import kept_tokens
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, RequestOutput, TokenLogprob, json_logprob
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
from zmqworker.serve.protocol import ChatCompletionRequest
from zmqworker.serve.request_id import request_id
from zmqworker.serve.text_pool import TextPool
from zmqworker.serve.tool_calls import ToolCallStream, tool_message
from zmqworker.serve.tool_parsers import ToolParser
from zmqworker.serve.tools import ToolOptions


async def create_chat_completion(
    llm: Frontend,
    model: str,
    body: ChatCompletionRequest,
    http: HTTPRequest,
    text: TextPool,
    tools: ToolOptions,
) -> JSONResponse | StreamingResponse:
    calls = _Calls(body, body.tool_parser(tools))  # an "auto" the server cannot read: 400
    prompt = await text.run(_prompt, llm, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = body.num_logprobs()
    params = sampling_params(llm, body, len(prompt), max_tokens, logprobs, "top_logprobs")
    head = {"id": f"chatcmpl-{request_id(http)}", "created": now(), "model": model}
    if body.stream:
        return StreamingResponse(
            _stream(llm, prompt, params, head, body.stream_usage(), calls),
            media_type="text/event-stream",
        )
    finals = await until_disconnected(http, _finals(llm, prompt, params))
    choices = []
    for i, out in enumerate(finals):
        message = calls.message(out.text)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _logprobs(out.logprobs) if out.logprobs is not None else None,
                "finish_reason": calls.finish_reason(out, "tool_calls" in message),
                "stop_reason": out.stop_reason,
            }
        )
    return JSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(finals),
            "prompt_logprobs": prompt_logprobs(finals[0]),
        }
    )


def _prompt(llm: Frontend, body: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids through the chat template, checked against the model
    (text work: in the text pool)."""
    try:
        keep = kept_tokens(body.truncate_prompt_tokens, llm.max_model_len)
    except ValueError as exc:
        raise APIError.from_value_error(exc, param="truncate_prompt_tokens") from None
    try:
        prompt = llm.chat_prompt(
            [m.as_openai_message() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.add_special_tokens is True,  # vLLM's default for chat
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=body.template_tools(),
        )
        return llm.encode(prompt, keep)
    except ValueError as exc:
        named = re.match(r"\w+", str(exc))
        option = named.group() if named else None
        param = option if option in _TEMPLATE_OPTIONS else "messages"
        raise APIError.from_value_error(exc, param=param) from None


_TEMPLATE_OPTIONS = ("continue_final_message", "chat_template_kwargs")


class _Calls:
    """How a request's replies are read: with its tool parser (None: content only)."""

    def __init__(self, body: ChatCompletionRequest, parser: ToolParser | None) -> None:
        self.parser = parser
        self.parallel = body.parallel()
        self.named = body.forced() and body.choice() != "required"

    def message(self, text: str) -> dict[str, Any]:
        if self.parser is None:
            return {"role": "assistant", "content": text}
        return tool_message(self.parser, text, self.parallel)

    def stream(self) -> ToolCallStream | None:
        return None if self.parser is None else ToolCallStream(self.parser, self.parallel)

    def finish_reason(self, out: RequestOutput, called: bool) -> str | None:
        """ "tool_calls" when the model stopped after calls of its choosing; a named
        function's call ends as "stop" (OpenAI's), one cut short as "length"."""
        reason = finish_reason(out)
        return "tool_calls" if called and reason == "stop" and not self.named else reason


async def _finals(llm: Frontend, prompt: list[int], params: Any) -> list[RequestOutput]:
    """Each choice's last output, in choice order."""
    finals: dict[int, RequestOutput] = {}
    async for index, out in run_prompts(llm, [prompt], [params]):
        finals[index] = out
    return [finals[i] for i in range(params.n)]


async def _stream(
    llm: Frontend,
    prompt: list[int],
    params: Any,
    head: dict[str, Any],
    stream_usage: tuple[bool, bool],
    calls: _Calls,
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    include_usage, continuous = stream_usage  # continuous: usage in every chunk too
    empty = {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}

    def chunk(index: int, delta: dict[str, Any], at: dict[str, int], **choice: Any) -> str:
        usage_now = {"usage": at} if continuous else {}
        return sse({**head, "choices": [{"index": index, "delta": delta, **choice}], **usage_now})

    for index in range(params.n):
        role = {"role": "assistant", "content": ""}
        yield chunk(index, role, empty, logprobs=None, finish_reason=None)
    sent = [0] * params.n  # positions whose logprobs were sent, per choice
    streams = [calls.stream() for _ in range(params.n)]
    finals: list[RequestOutput] = []
    try:
        async for index, out in run_prompts(llm, [prompt], [params]):
            logprobs = None
            if out.logprobs is not None:
                logprobs = _logprobs(out.logprobs[sent[index] :])
                sent[index] = len(out.logprobs)
            tool_stream = streams[index]
            if tool_stream is None:
                deltas = [{"content": out.new_text}] if out.new_text or logprobs else []
            else:  # text a call may start with is held until the next text tells
                deltas = tool_stream.step(out.new_text, out.finished) or ([{}] if logprobs else [])
            at = chunk_usage(out)
            for delta in deltas:
                yield chunk(index, delta, at, logprobs=logprobs, finish_reason=None)
                logprobs = None
            if out.finished:
                called = tool_stream is not None and tool_stream.called
                reason, stop_reason = calls.finish_reason(out, called), out.stop_reason
                yield chunk(
                    index, {}, at, logprobs=None, finish_reason=reason, stop_reason=stop_reason
                )
                finals.append(out)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(finals)})
    except Exception as exc:  # tell the client, then end the stream
        yield sse(APIError.of(exc).body())
    yield sse("[DONE]")


def _logprobs(positions: list[PositionLogprobs]) -> dict[str, Any]:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top tokens."""

    def entry(token: TokenLogprob) -> dict[str, Any]:
        text = token.text or ""
        return {"token": text, "logprob": json_logprob(token.logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(p.sampled), "top_logprobs": [entry(t) for t in p.top]} for p in positions
        ]
    }
