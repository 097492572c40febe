"""A request body as the struct it must be, or an APIError in the user's words that names
the field (param) at fault: a JSON syntax error by line and column, a wrong type or value
by its path (messages[0].role), text that is not valid Unicode by the field holding it."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec

from zmqworker.engine.prompts import check_text
from zmqworker.serve.errors import APIError

Request = TypeVar("Request", bound=msgspec.Struct)


@runtime_checkable
class Checked(Protocol):
    """A body with rules no type can say: check() raises an APIError naming the field."""

    def check(self) -> None: ...


# msgspec's wording: "<problem> - at `$.messages[0].role`", syntax errors "(byte 61)".
_AT = re.compile(r"^(.*?)(?: - at `\$\.?(.*)`)?$", re.S)
_BYTE = re.compile(r"^JSON is malformed: (.*) \(byte (\d+)\)$")
_TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "an array",
    "object": "an object",
    "null": "null",
}


def decode_body(body: bytes, kind: type[Request]) -> Request:
    """The body decoded as kind, and checked if kind has rules of its own (Checked)."""
    if not body.strip():
        raise APIError("the request body is empty: expected a JSON object")
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None
    except msgspec.DecodeError as exc:
        if "surrogate" in str(exc):
            _refuse_lone_surrogate(body)
        raise _syntax_error(body, str(exc)) from None
    if isinstance(request, Checked):
        request.check()
    return request


def _invalid(message: str) -> APIError:
    """A value of the wrong type or out of range, or a field unknown or missing."""
    problem, path = _AT.match(message).groups()  # type: ignore[union-attr]
    path = path or ""
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", problem):
        field = _join(path, m.group(1))
        return APIError(f"Unrecognized request argument supplied: {field}", param=field)
    if m := re.fullmatch(r"Object missing required field `(.*)`", problem):
        field = _join(path, m.group(1))
        return APIError(f"{field} is required", param=field)
    if m := re.fullmatch(r"Expected `(.*)`, got `(.*)`", problem):
        problem = f"expected {_type_names(m.group(1))}, got {_type_names(m.group(2))}"
    elif m := re.fullmatch(r"Expected `(\w+)` of length ([<>]=) (\d+)", problem):
        kind, op, size = m.groups()
        unit = "characters" if kind == "str" else "items"
        bound = "at least" if op == ">=" else "at most"
        problem = (
            "must not be empty" if (op, size) == (">=", "1") else f"must have {bound} {size} {unit}"
        )
    elif m := re.fullmatch(r"Expected `(\w+)` ([<>]=?) (.*)", problem):
        problem = f"must be {m.group(2)} {m.group(3)}"
    elif problem == "Number out of range":
        problem = "the number is out of range"
    return APIError(f"{path or 'the request body'}: {problem}", param=path or None)


def _syntax_error(body: bytes, message: str) -> APIError:
    """JSON that does not parse, located by line and column."""
    if m := _BYTE.match(message):
        reason, at = m.group(1), int(m.group(2))
    elif message == "Input data was truncated":
        reason, at = "the body ends inside the JSON", len(body)
    else:  # invalid UTF-8
        try:
            body.decode("utf-8")
            reason, at = message, 0
        except UnicodeDecodeError as exc:
            reason, at = "the body is not valid UTF-8", exc.start
    line = body.count(b"\n", 0, at) + 1
    column = len(body[body.rfind(b"\n", 0, at) + 1 : at].decode("utf-8", "replace")) + 1
    return APIError(f"JSON syntax error at line {line}, column {column}: {reason}")


def _refuse_lone_surrogate(body: bytes) -> None:
    """msgspec refuses a lone surrogate escape ("\\udcff") as malformed JSON; Python's
    json takes it, so that the field holding it can be named."""
    try:
        value = json.loads(body)
    except ValueError:
        return
    _check_texts(value, "")


def _check_texts(value: Any, path: str) -> None:
    """An APIError naming the first string (or key) under value that is not valid Unicode."""
    if isinstance(value, str):
        try:
            check_text(value, path or "the body")
        except ValueError as exc:
            raise APIError(str(exc), param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_texts(key, _join(path, key))
            _check_texts(item, _join(path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_texts(item, f"{path}[{i}]")


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _type_names(types: str) -> str:
    names = [_TYPE_NAMES.get(t, t) for t in types.split(" | ")]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
