"""A chat reply's tool calls in OpenAI's shapes: the whole message's tool_calls, and a
stream's deltas. A streamed call comes first with its id, type and name, then its
arguments in pieces, each delta {"tool_calls": [{"index", ...}]}; content before the
first call streams as content. Ids are vLLM's: chatcmpl-tool-<32 hex digits>."""

from __future__ import annotations

import secrets
from typing import Any

from zmqworker.serve.tool_parsers import Parsed, ParsedCall, ToolParser


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def tool_message(parser: ToolParser, text: str, parallel: bool) -> dict[str, Any]:
    """The assistant message of a whole reply: its calls, or text alone when it holds
    none. parallel=False keeps the first call only (vLLM's parallel_tool_calls)."""
    parsed = parser.parse(text, final=True)
    calls = _allowed(parsed, parallel)
    if not calls:
        return {"role": "assistant", "content": text}
    tool_calls = [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}


class ToolCallStream:
    """One choice's reply as it streams: step() takes the new text and answers the deltas
    to send. A parser's partial parses only grow (tool_parsers/calls.py), so each delta
    is what the parse holds beyond what was sent."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.content_sent = 0  # characters of the content sent
        self.sent: list[int] = []  # per call sent, the characters of its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def step(self, new_text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas for new_text (final: the reply is complete)."""
        self.text += new_text
        parsed = self.parser.parse(self.text, final)
        deltas: list[dict[str, Any]] = []
        # Once a call has started, content is done (text between calls is not sent).
        if not self.sent and len(parsed.content) > self.content_sent:
            deltas.append({"content": parsed.content[self.content_sent :]})
            self.content_sent = len(parsed.content)
        entries = [
            entry
            for index, call in enumerate(_allowed(parsed, self.parallel))
            if (entry := self._entry(index, call)) is not None
        ]
        if entries:
            deltas.append({"tool_calls": entries})
        return deltas

    def _entry(self, index: int, call: ParsedCall) -> dict[str, Any] | None:
        if index == len(self.sent):
            self.sent.append(len(call.arguments))
            function = {"name": call.name, "arguments": call.arguments}
            return {"index": index, "id": call_id(), "type": "function", "function": function}
        if index < len(self.sent) and len(call.arguments) > self.sent[index]:
            piece = call.arguments[self.sent[index] :]
            self.sent[index] = len(call.arguments)
            return {"index": index, "function": {"arguments": piece}}
        return None


def _allowed(parsed: Parsed, parallel: bool) -> list[ParsedCall]:
    return parsed.calls if parallel else parsed.calls[:1]
