"""Hermes-style tool calls, as Qwen2, Qwen2.5 and Qwen3 write them (vLLM's `hermes`
parser): each call a JSON object {"name": ..., "arguments": {...}} between <tool_call>
and </tool_call>, after any text. The content is the text before the first call; text
between and after calls is dropped. The last call may lack its closing tag (the model
stopped right after the object). A call needs its "arguments" and a name among the
request's tools: otherwise the whole reply is content."""

from __future__ import annotations

from collections.abc import Collection

from zmqworker.serve.tool_parsers.calls import Parsed, ParsedCall, held_back, read_call
from zmqworker.serve.tool_parsers.json_scan import skip_space

START = "<tool_call>"
END = "</tool_call>"
_ARGUMENTS = ("arguments",)


class HermesParser:
    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names  # the request's tools' (None: any name)

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else text[: len(text) - held_back(text, START)])
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            body = pos + len(START)
            close = text.find(END, body)
            call = self._call(text[body:] if close < 0 else text[body:close], final)
            if call is None:
                if final:
                    return Parsed(text)
                break
            calls.append(call)
            if close < 0:
                break
            pos = text.find(START, close + len(END))
        return Parsed(text[:first], calls)

    def _call(self, body: str, final: bool) -> ParsedCall | None:
        """The call in one tag's body; None when malformed or, while streaming, not named
        yet."""
        start = skip_space(body, 0)
        if start == len(body) or body[start] != "{":
            return None
        read = read_call(body, start, _ARGUMENTS, final, self.names)
        if read is None:
            return None
        if final and skip_space(body, read.end or 0) != len(body):
            return None  # more than one object in the tag
        return read.call
