"""The LLM's keyword arguments as definitions: each one's type carries its range and help
(msgspec Meta), so that the LLM checks them and the CLI derives its options from them."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

Positive = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(gt=0, le=1)]
Seconds = Annotated[float, Meta(gt=0)]
GiB = Annotated[float, Meta(ge=0)]
AtLeastMinusOne = Annotated[int, Meta(ge=-1)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # as a request's seed; msgpack's


def opt(description: str, **extra: Any) -> Meta:
    """An argument's help and CLI extras (flag: its name there, aliases, unit), read where
    the CLI derives its options (zmqworker/cli/options.py)."""
    return Meta(description=description, extra=extra)


def arg_types(function: Callable[..., Any]) -> dict[str, Any]:
    """function's keyword arguments and their types, Annotated metadata included."""
    hints = typing.get_type_hints(function, include_extras=True)
    return {name: hints[name] for name in inspect.signature(function).parameters if name in hints}


def check_args(types_by_name: dict[str, Any], values: dict[str, Any]) -> None:
    """Raise ValueError naming the first argument outside its type or range. A callable
    where the type allows one (an executor factory) is taken as it is."""
    for name, value in values.items():
        checkable = _without_callables(types_by_name[name])
        if callable(value) and checkable != types_by_name[name]:
            continue
        try:
            msgspec.convert(value, checkable)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None


def _without_callables(hint: Any) -> Any:
    """hint with the Callable members of its unions dropped (msgspec cannot check them)."""
    if typing.get_origin(hint) is Annotated:
        return Annotated[(_without_callables(hint.__origin__), *hint.__metadata__)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kept = [a for a in typing.get_args(hint) if typing.get_origin(a) is not Callable]
        return typing.Union[tuple(kept)] if len(kept) > 1 else kept[0]  # noqa: UP007
    return hint
