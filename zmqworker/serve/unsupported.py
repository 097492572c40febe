"""The OpenAI features this server does not implement, in one place: a request that asks
for one is refused with a message that says so. A field here is taken at its neutral
value only; a feature that comes removes its row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zmqworker.serve.errors import APIError

# field: (is its value neutral?, what the refusal says)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: not v, "suffix is not supported: a completion only continues its prompt"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
    "modalities": (
        lambda v: v in (None, ["text"]),
        'modalities other than ["text"] are not supported',
    ),
    "web_search_options": (lambda v: v is None, "web_search_options is not supported"),
    "functions": (lambda v: not v, "functions is not supported: give tools"),
    "function_call": (lambda v: v is None, "function_call is not supported: give tool_choice"),
}

# Content part types OpenAI defines besides text, by what they carry.
_PART_KINDS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def refuse_unsupported(request: object) -> None:
    """An APIError naming the first field of request that asks for what is not supported."""
    for field, (neutral, message) in UNSUPPORTED.items():
        if hasattr(request, field) and not neutral(getattr(request, field)):
            raise APIError(message, param=field)


def unsupported_part(part_type: str) -> str:
    """The refusal of a message content part that is not text."""
    kind = _PART_KINDS.get(part_type, repr(part_type))
    return f"{kind} content parts are not supported: only text"
