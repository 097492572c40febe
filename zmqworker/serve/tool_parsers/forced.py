"""The outputs of tool_choice "required" and of a named function, which structured
outputs force into a shape (serve/tools.py builds the schema): a JSON array of
{"name", "parameters"} objects, and the named function's arguments alone."""

from __future__ import annotations

from zmqworker.serve.tool_parsers.calls import Parsed, ParsedCall, read_call
from zmqworker.serve.tool_parsers.json_scan import skip_space

_ARGUMENTS = ("parameters",)


class RequiredParser:
    """[{"name": ..., "parameters": {...}}, ...]: a text cut short (max_tokens) is content."""

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if pos == len(text) or text[pos] != "[":
            return Parsed(text if final else "")
        calls: list[ParsedCall] = []
        pos = skip_space(text, pos + 1)
        while pos < len(text) and text[pos] == "{":
            read = read_call(text, pos, _ARGUMENTS, final, None)  # the schema's names
            if read is None or read.call is None:
                break
            calls.append(read.call)
            if read.end is None:
                break
            pos = skip_space(text, read.end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_space(text, pos + 1)
            elif pos < len(text) and text[pos] == "]":
                if final and (not calls or skip_space(text, pos + 1) != len(text)):
                    break
                return Parsed("", calls)
        return Parsed(text) if final else Parsed("", calls)


class NamedParser:
    """The whole output is the named function's arguments (spaces around them dropped)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.name, text.strip())])
