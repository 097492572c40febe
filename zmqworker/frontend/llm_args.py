"""The LLM's keyword arguments as definitions: each one's type carries its range and help
(msgspec Meta), so that the LLM checks them and the CLI derives its options from them."""

from __future__ import annotations

import inspect
import os
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
    """function's keyword arguments and their types, Annotated metadata included (not a
    **kwargs catch-all)."""
    hints = typing.get_type_hints(function, include_extras=True)
    parameters = inspect.signature(function).parameters.values()
    return {
        p.name: hints[p.name]
        for p in parameters
        if p.name in hints and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


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
            allowed = _literal_values(checkable)
            also = f" (one of {', '.join(map(repr, allowed))})" if allowed else ""
            raise ValueError(f"{name}={value!r}: {exc}{also}") from None


def _literal_values(hint: Any) -> list[Any]:
    """The values of the Literal types in hint (through Annotated and unions)."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _literal_values(hint.__origin__)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return [v for a in typing.get_args(hint) for v in _literal_values(a)]
    return []


# vLLM's names for dtypes (and torch.dtype's own, "torch.float16"), as the LLM's.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}

# vLLM's LLM arguments taken for compatibility: the neutral values each may have here.
# Any other value is refused with the sentence given.
VLLM_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "trust_remote_code": ((False,), "the engine's own model classes run, no checkpoint code"),
    "kv_cache_dtype": (("auto",), "the KV cache holds the model's dtype"),
    "swap_space": ((0, None), "preempted requests are recomputed (see kv_offloading_size)"),
    "disable_log_stats": ((True, False), ""),
    "tokenizer": ((None,), "the tokenizer is the model folder's"),
}  # fmt: skip


def vllm_options(options: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """options with vLLM's spellings made the LLM's (dtype aliases and torch dtypes,
    seed=None as 0), after extra (the LLM's other keyword arguments) is checked: vLLM's
    arguments of VLLM_NEUTRAL are taken with a neutral value (tokenizer: the model folder
    itself), refused with another; any other is a TypeError, as Python's."""
    options = dict(options)
    dtype = options.get("dtype")
    if type(dtype).__name__ == "dtype" and str(dtype).startswith("torch."):
        dtype = str(dtype).removeprefix("torch.")
    options["dtype"] = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if options.get("seed", 0) is None:
        options["seed"] = 0
    for name, value in extra.items():
        if name not in VLLM_NEUTRAL:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        neutral, why = VLLM_NEUTRAL[name]
        if name == "tokenizer" and _same_folder(value, options.get("model")):
            continue
        if not any(value is v or _equal(value, v) for v in neutral):
            raise ValueError(f"{name}={value!r} is not supported: {why}")
    return options


def _equal(value: Any, neutral: Any) -> bool:
    """value == neutral, a bool never equal to a number (trust_remote_code=0 is no False)."""
    if isinstance(value, bool) or isinstance(neutral, bool) or neutral is None:
        return False
    return bool(value == neutral)


def _same_folder(a: Any, b: Any) -> bool:
    if not isinstance(a, str | os.PathLike) or not isinstance(b, str | os.PathLike):
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def _without_callables(hint: Any) -> Any:
    """hint with the Callable members of its unions dropped (msgspec cannot check them)."""
    if typing.get_origin(hint) is Annotated:
        return Annotated[(_without_callables(hint.__origin__), *hint.__metadata__)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kept = [a for a in typing.get_args(hint) if typing.get_origin(a) is not Callable]
        return typing.Union[tuple(kept)] if len(kept) > 1 else kept[0]  # noqa: UP007
    return hint
