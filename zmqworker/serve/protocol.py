"""The request bodies of the OpenAI API that the server takes, as pydantic models
(FastAPI validates them). Fields OpenAI defines and we do not implement are accepted at
their neutral value only; any other value, or a field OpenAI does not define, is a 400
that names it. top_k, min_p, ignore_eos and stop_token_ids are vLLM's extensions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zmqworker.serve.errors import APIError

TokenIds = list[Annotated[int, Field(ge=0)]]
MAX_LOGPROBS = 20  # the OpenAI API's bound, and the workers' default max_logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _neutral(self) -> SamplingRequest:
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options needs stream=true", param="stream_options")
        return self

    def stop_strings(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _echo(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise APIError("echo with logprobs is not supported", param="echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError("prompt is empty", param="prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as a chat template takes it ("developer" is OpenAI's new name for
        the system role)."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
