"""A chat request's messages, as msgspec structs (the body is decoded straight into
them), checked whole (check) and turned into what a chat template takes. Besides
OpenAI's fields, an assistant message may carry vLLM's reasoning (or reasoning_content,
as clients of reasoning models send it back): as vLLM does, it reaches the template as
both `reasoning` and `reasoning_content`, which a template that knows no reasoning
ignores."""

from __future__ import annotations

import json
from typing import Any

from msgspec import Struct

from zmqworker.serve.errors import APIError
from zmqworker.serve.unsupported import MESSAGE_UNSUPPORTED, refuse_unsupported, unsupported_part

ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(Struct, forbid_unknown_fields=True):
    """A part of a message's content: text. Other kinds are decoded to be refused by name."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None  # None: an assistant's tool calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # vLLM's: an assistant's reasoning, sent back in the conversation.
    reasoning: str | None = None
    reasoning_content: str | None = None
    # What a chat response's message holds besides (its model_dump() sent back as is):
    # neutral here, else refused by name (unsupported.py).
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: Any = None

    def check(self, where: str) -> None:
        refuse_unsupported(self, MESSAGE_UNSUPPORTED, f"{where}.")
        if self.role not in ROLES:
            raise APIError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {self.role!r}",
                param=f"{where}.role",
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise APIError(
                f"{where}.tool_calls: only an assistant message carries tool calls",
                param=f"{where}.tool_calls",
            )
        for field in ("reasoning", "reasoning_content"):
            if getattr(self, field) is not None and self.role != "assistant":
                raise APIError(
                    f"{where}.{field}: only an assistant message carries reasoning",
                    param=f"{where}.{field}",
                )
        if self.role == "tool" and self.tool_call_id is None:
            raise APIError(
                f"{where}.tool_call_id is required in a tool message",
                param=f"{where}.tool_call_id",
            )
        for j, call in enumerate(self.tool_calls or []):
            _arguments(call, f"{where}.tool_calls[{j}]")
        if self.content is None:
            if not self.tool_calls:
                raise APIError(
                    f"{where}.content is required (only an assistant message with tool_calls "
                    "may leave it out)",
                    param=f"{where}.content",
                )
            return
        if isinstance(self.content, str):
            return
        for j, part in enumerate(self.content):
            at = f"{where}.content[{j}]"
            if part.type != "text":
                raise APIError(unsupported_part(part.type), param=at)
            if part.text is None:
                raise APIError(f"{at}.text is required in a text part", param=f"{at}.text")

    def as_openai_message(self) -> dict[str, Any]:
        """The message as a dict in OpenAI's shape, as LLM.chat takes it (Frontend's
        chat_prompt gives it to the template by engine/prompts.template_messages' rules),
        its reasoning under both names."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            message["content"] = [{"type": "text", "text": part.text} for part in self.content]
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
                for call in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


def _arguments(call: ToolCall, where: str) -> dict[str, Any]:
    """A call's arguments, which must be a JSON object."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(
            f"{where}.function.arguments must be a JSON object, got {call.function.arguments!r}",
            param=f"{where}.function.arguments",
        )
    return arguments
