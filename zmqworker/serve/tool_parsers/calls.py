"""What every tool-call format shares: the parse of a model's output (content and calls),
the parser's interface, and reading one call written as a JSON object {"name": ...,
<arguments key>: {...}}.

A parser reads the whole text so far each time. With final=False the text may still grow,
and what it returns must stay true of every longer text: content and each call's
arguments only grow, a call appears once its name is complete. That is what lets a stream
send differences (stream.py) and end with what the whole text parses to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from zmqworker.serve.tool_parsers.json_scan import scan_object


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it (so far, when streaming)


@dataclass(frozen=True)
class Parsed:
    content: str  # the text that is not a call ("" when none)
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> Parsed:
        """text's content and calls; with final, a text that does not hold well-formed
        calls is all content (Parsed(text))."""
        ...


@dataclass(frozen=True)
class ReadCall:
    call: ParsedCall | None  # None until the name is complete
    end: int | None  # just past the object; None while it is open


def read_call(text: str, pos: int, argument_keys: tuple[str, ...], final: bool) -> ReadCall | None:
    """The call written as the object at text[pos] ("{"); None when it is malformed (with
    final: anything but a complete object with a string name and object arguments)."""
    scan = scan_object(text, pos)
    if scan is None or (final and scan.end is None):
        return None
    arguments_span = next((scan.fields[k] for k in argument_keys if k in scan.fields), None)
    if final:
        try:
            whole = json.loads(text[pos : scan.end])
        except ValueError:
            return None
        arguments = next((whole[k] for k in argument_keys if k in whole), {})
        if not isinstance(whole.get("name"), str) or not isinstance(arguments, dict):
            return None
        raw = "{}" if arguments_span is None else text[arguments_span.start : arguments_span.end]
        return ReadCall(ParsedCall(whole["name"], raw), scan.end)
    name_span = scan.fields.get("name")
    if name_span is None or not name_span.complete:
        return ReadCall(None, scan.end)
    name = json.loads(text[name_span.start : name_span.end])
    if not isinstance(name, str):
        return None
    raw = ""
    if arguments_span is not None and text[arguments_span.start] == "{":
        raw = text[arguments_span.start : arguments_span.end]
    return ReadCall(ParsedCall(name, raw), scan.end)


def held_back(text: str, marker: str) -> int:
    """How many characters at text's end could be the start of marker (kept from the
    content until the next text tells)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
