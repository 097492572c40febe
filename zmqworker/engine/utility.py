"""Utility calls: the engine core methods a client may call by name, between two steps.

Only the methods named in UTILITY_METHODS are callable; their arguments are checked
against the method's own type hints (msgspec), so a bad one is an error naming it. A
method marked to wait runs once every step in flight has come back and been applied:
it never lands mid-step.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

import msgspec

from messages import UtilityCall

# name -> whether the steps in flight are finished before it runs.
UTILITY_METHODS: dict[str, bool] = {
    "check_health": False,
    "stats": False,
    "collective_rpc": True,
}


def waits_for_steps(method: str) -> bool:
    return UTILITY_METHODS.get(method, False)


def call_utility(target: object, call: UtilityCall) -> Any:
    """Run call.method of target (an EngineCore) with the call's arguments, each
    converted to its parameter's type; AttributeError for a method not in the allowlist,
    TypeError or ValueError for arguments that do not fit."""
    if call.method not in UTILITY_METHODS:
        raise AttributeError(
            f"{call.method!r} is not an engine core utility; those are "
            f"{', '.join(sorted(UTILITY_METHODS))}"
        )
    method = getattr(target, call.method)
    bound = inspect.signature(method).bind(*call.args, **call.kwargs)
    hints = parameter_types(type(target), call.method)
    for name, value in bound.arguments.items():
        try:
            bound.arguments[name] = msgspec.convert(value, hints[name])
        except msgspec.ValidationError as exc:
            raise ValueError(f"{call.method}: argument {name}: {exc}") from None
    return method(*bound.args, **bound.kwargs)


@functools.cache
def parameter_types(cls: type, method: str) -> dict[str, Any]:
    """The declared types of a utility method's parameters (Any where none is given)."""
    function = getattr(cls, method)
    hints = typing.get_type_hints(function)
    names = list(inspect.signature(function).parameters)[1:]  # not self
    return {name: hints.get(name, Any) for name in names}
