"""Where the top-level keys' values of a JSON object lie in a text that may still be
growing: a tool call's name can be read, and its arguments streamed, before the model has
finished the object. The scanner finds spans only; a finished text is validated by
json.loads (calls.py), so what it accepts of a malformed text does not matter there."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NESTING = re.compile(r'["{}\[\]]')  # what changes the depth, or starts a string
_SCALAR = re.compile(r"[-+.0-9A-Za-z]*")  # a number, true, false or null
_SPACE = re.compile(r"[ \t\r\n]*")


@dataclass(frozen=True)
class Span:
    """text[start:end] is a value; while it is not complete, end is the end of the text."""

    start: int
    end: int
    complete: bool


@dataclass(frozen=True)
class ObjectScan:
    fields: dict[str, Span]  # each top-level key seen, with its value's span
    end: int | None  # just past the closing brace; None while the object is open


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def scan_object(text: str, pos: int) -> ObjectScan | None:
    """The object starting at text[pos] ("{"), as far as the text goes; None when what is
    there cannot be the start of an object."""
    fields: dict[str, Span] = {}
    pos += 1
    while True:
        pos = skip_space(text, pos)
        if pos == len(text):
            return ObjectScan(fields, None)
        if text[pos] == "}" and not fields:
            return ObjectScan(fields, pos + 1)
        key = _STRING.match(text, pos)
        if key is None:
            return ObjectScan(fields, None) if _open_string(text, pos) else None
        try:
            name = json.loads(key.group())
        except ValueError:
            return None
        pos = skip_space(text, key.end())
        if pos == len(text):
            return ObjectScan(fields, None)
        if text[pos] != ":":
            return None
        pos = skip_space(text, pos + 1)
        if pos == len(text):
            return ObjectScan(fields, None)
        span = value_span(text, pos)
        fields[name] = span
        if not span.complete:
            return ObjectScan(fields, None)
        pos = skip_space(text, span.end)
        if pos == len(text):
            return ObjectScan(fields, None)
        if text[pos] == "}":
            return ObjectScan(fields, pos + 1)
        if text[pos] != ",":
            return None
        pos += 1


def value_span(text: str, pos: int) -> Span:
    """The value starting at text[pos] (not a space). A number or literal is complete only
    once something follows it: "12" may still become "123"."""
    first = text[pos]
    if first == '"':
        string = _STRING.match(text, pos)
        return Span(pos, string.end(), True) if string else Span(pos, len(text), False)
    if first in "{[":
        depth, at = 0, pos
        while (found := _NESTING.search(text, at)) is not None:
            char = found.group()
            if char == '"':
                string = _STRING.match(text, found.start())
                if string is None:
                    break
                at = string.end()
                continue
            depth += 1 if char in "{[" else -1
            at = found.end()
            if depth == 0:
                return Span(pos, at, True)
        return Span(pos, len(text), False)
    end = _SCALAR.match(text, pos).end()  # type: ignore[union-attr]
    return Span(pos, end, end < len(text) and end > pos)


def _open_string(text: str, pos: int) -> bool:
    """text[pos:] is a string not closed yet."""
    return text[pos] == '"' and _STRING.match(text, pos) is None
