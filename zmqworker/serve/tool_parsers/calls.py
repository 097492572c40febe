"""What every tool-call format shares: the parse of a model's output (content and calls),
the parser's interface, and reading one call written as a JSON object {"name": ...,
<arguments key>: {...}}.

A call names one of the request's tools and has its arguments key (vLLM's parsers need
it too): an object without them (a JSON reply that happens to have a "name", a function
the request does not offer) is content, whole or streamed.

A parser reads the whole text so far each time. With final=False the text may still grow,
and what it returns must stay true of every longer text: content and each call's
arguments only grow, a call appears once its name is complete, is one of the tools', and
its arguments have started. That is what lets a stream send differences (stream.py) and
end with what the whole text parses to."""

from __future__ import annotations

import json
from collections.abc import Collection
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
    call: ParsedCall | None  # None until the name is complete and the arguments started
    end: int | None  # just past the object; None while it is open


def read_call(
    text: str,
    pos: int,
    argument_keys: tuple[str, ...],
    final: bool,
    names: Collection[str] | None,
) -> ReadCall | None:
    """The call written as the object at text[pos] ("{"); None when it is not one (with
    final: anything but a complete object with a string name among names (None: any) and
    object arguments under one of argument_keys; while streaming, as soon as what is there
    shows that the whole object cannot be one)."""
    scan = scan_object(text, pos)
    if scan is None or (final and scan.end is None):
        return None
    arguments_span = next((scan.fields[k] for k in argument_keys if k in scan.fields), None)
    if final:
        try:
            whole = json.loads(text[pos : scan.end])
        except ValueError:
            return None
        key = next((k for k in argument_keys if k in whole), None)
        name = whole.get("name")
        if key is None or not isinstance(whole[key], dict) or not _known(name, names):
            return None
        assert arguments_span is not None
        raw = text[arguments_span.start : arguments_span.end]
        return ReadCall(ParsedCall(name, raw), scan.end)
    name_span = scan.fields.get("name")
    if name_span is None or not name_span.complete:
        # An object that closed without a name, or without arguments, is no call.
        return None if scan.end is not None else ReadCall(None, None)
    name = json.loads(text[name_span.start : name_span.end])
    if not _known(name, names):
        return None
    if arguments_span is None:
        return None if scan.end is not None else ReadCall(None, None)
    if text[arguments_span.start] != "{":
        return None  # arguments that are not an object
    return ReadCall(ParsedCall(name, text[arguments_span.start : arguments_span.end]), scan.end)


def _known(name: object, names: Collection[str] | None) -> bool:
    return isinstance(name, str) and (names is None or name in names)


def held_back(text: str, marker: str) -> int:
    """How many characters at text's end could be the start of marker (kept from the
    content until the next text tells)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
