"""Llama 3's JSON tool calls (vLLM's `llama3_json` parser): the reply is one or more JSON
objects {"name": ..., "parameters": {...}} ("arguments" is read too), separated by ";",
after <|python_tag|> when special tokens are kept. A reply that starts otherwise is
content: Llama 3 writes a call as the whole reply, never after text. An object without
parameters or arguments, or naming a function the request's tools do not hold, is no
call: a JSON reply ({"name": "John", "age": 25}) is content, and streams as content as
soon as its first object shows it."""

from __future__ import annotations

from collections.abc import Collection

from zmqworker.serve.tool_parsers.calls import Parsed, ParsedCall, held_back, read_call
from zmqworker.serve.tool_parsers.json_scan import skip_space

PYTHON_TAG = "<|python_tag|>"
_ARGUMENTS = ("parameters", "arguments")


class Llama3JsonParser:
    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names  # the request's tools' (None: any name)

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and held_back(text[pos:], PYTHON_TAG) == len(text) - pos:
            return Parsed("")  # spaces, or the start of the tag: too early to tell
        if pos == len(text) or text[pos] != "{":
            return Parsed(text if final or pos < len(text) else "")
        calls: list[ParsedCall] = []
        while True:
            read = read_call(text, pos, _ARGUMENTS, final, self.names)
            if read is None:  # no call: the whole reply is content (once the first shows it)
                return Parsed(text) if final or not calls else Parsed("", calls)
            if read.call is None:
                return Parsed("", calls)
            calls.append(read.call)
            if read.end is None:
                return Parsed("", calls)
            pos = skip_space(text, read.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_space(text, pos + 1)
            if pos == len(text):
                return Parsed("", calls)
            if text[pos] != "{":
                return Parsed(text) if final else Parsed("", calls)
