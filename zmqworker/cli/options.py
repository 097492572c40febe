"""CLI options derived from what they set: the LLM's keyword arguments and the fields of
SamplingParams, with their names, types, ranges, defaults and help. A new argument or field
is a new option; none can fall behind or disagree on a default.

Flags are the names with dashes (max_num_seqs: --max-num-seqs), or the "flag" of the
definition's Meta extra, plus the "aliases" listed there ("metavar" names the value in
the help). A list is given by repeating its option; a list of lists as comma-separated
values (--bad-words-token-ids 1,2,3), a map as KEY=VALUE (--logit-bias 42=-5), both
repeated. Options the user did not give stay out of the parsed namespace, so the
definitions' own defaults (and the model's generation defaults) apply.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

_METAVARS = {int: "N", float: "X", str: "TEXT"}
_SIZE = re.compile(r"(?i)^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$")


@dataclass(frozen=True)
class Option:
    name: str  # the keyword or field it sets
    hint: Any  # its type, Annotated constraints included
    default: Any
    description: str
    flags: tuple[str, ...]
    unit: str | None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """Its attribute in the parsed namespace: its flag's (seed and engine_seed differ)."""
        return self.flags[0].lstrip("-").replace("-", "_")


def options_of(defaults: dict[str, Any], hints: dict[str, Any]) -> list[Option]:
    out = []
    for name, default in defaults.items():
        hint = hints[name]
        metas = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        extra: dict[str, Any] = {}
        description = ""
        for meta in metas:
            extra.update(meta.extra or {})
            description = meta.description or description
        flags = (extra.get("flag", f"--{name.replace('_', '-')}"), *extra.get("aliases", ()))
        option = Option(
            name, hint, default, description, flags, extra.get("unit"), extra.get("metavar")
        )
        out.append(option)
    return out


def llm_options(skip: Iterable[str] = ()) -> list[Option]:
    from zmqworker.frontend.llm import LLM, OPTION_TYPES

    params = inspect.signature(LLM).parameters
    defaults = {  # not **vllm_args, vLLM's arguments taken for compatibility
        n: p.default for n, p in params.items() if n not in set(skip) and n in OPTION_TYPES
    }
    return options_of(defaults, OPTION_TYPES)


def sampling_options() -> list[Option]:
    from messages import SamplingParams

    hints = typing.get_type_hints(SamplingParams, include_extras=True)
    fields = msgspec.structs.fields(SamplingParams)
    defaults = {
        f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        for f in fields
        if f.name != "structured_outputs"  # options of their own: cli/structured.py
    }
    return options_of(defaults, hints)


def add_options(group: Any, options: Iterable[Option], defaults: dict[str, Any] | None = None):
    """Add each option to an argparse group; defaults overrides the help's default text."""
    for option in options:
        shown = (defaults or {}).get(option.name, option.default)
        help_text = option.description or option.name
        if shown not in (None, [], "", {}):
            help_text += f" (default: {shown})"
        if option.unit == "bytes":
            help_text += "; 268435456, 256MiB or 1G"
        kwargs: dict[str, Any] = {"dest": option.dest, "default": argparse.SUPPRESS}
        base, item, choices = _parts(option.hint)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is list:
            # Repeated (--stop a --stop b): a list taking several words would swallow the
            # prompts after it.
            help_text += "; repeat for more"
            kwargs.update(action="append", type=_checked(item, option.hint, list_item=True))
            kwargs["metavar"] = option.metavar or _METAVARS.get(item, "VALUE")
        elif base is dict:
            help_text += "; repeat for more"
            kwargs["metavar"] = option.metavar or "KEY=VALUE"
            kwargs.update(action=_MergeDict, type=_entry(option.hint, kwargs["metavar"]))
        elif choices:
            kwargs["choices"] = choices
        else:
            kwargs["type"] = _checked(base, option.hint, unit=option.unit)
            scalar = "BYTES" if option.unit == "bytes" else _METAVARS.get(base, "VALUE")
            kwargs["metavar"] = option.metavar or scalar
        group.add_argument(*option.flags, help=help_text, **kwargs)


def given(args: argparse.Namespace, options: Iterable[Option]) -> dict[str, Any]:
    """The options the user gave, by the name they set."""
    return {o.name: getattr(args, o.dest) for o in options if hasattr(args, o.dest)}


def parse_size(text: str) -> int:
    """Bytes from "268435456", "256MiB", "256M", "1.5G" (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (try 268435456, 256MiB or 1G)")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


def _parts(hint: Any) -> tuple[Any, Any, list[str] | None]:
    """(base type, list item type, Literal choices) of a hint, None and Callables aside."""
    hint = _strip(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [
            _strip(a)
            for a in typing.get_args(hint)
            if a is not type(None) and typing.get_origin(a) is not Callable
        ]
        hint = members[0]
    if typing.get_origin(hint) is Literal:
        return str, None, list(typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return list, _strip(typing.get_args(hint)[0]), None
    if typing.get_origin(hint) is dict:
        return dict, None, None
    return hint, None, None


def _without_none(hint: Any) -> Any:
    """X of an optional X (X | None), else hint."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def _strip(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _checked(base: Any, hint: Any, unit: str | None = None, list_item: bool = False) -> Callable:
    """An argparse type: parse the text as base, then check it against the definition's
    constraints, so a bad value is reported as an error of that option."""
    item_hint = typing.get_args(_without_none(_strip(hint)))[0] if list_item else hint

    def convert(text: str) -> Any:
        try:
            if typing.get_origin(base) is list:  # a list in a list: comma-separated
                return msgspec.convert(text.split(","), item_hint, strict=False)
            value = parse_size(text) if unit == "bytes" else base(text)
            return msgspec.convert(value, item_hint)
        except (ValueError, msgspec.ValidationError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(base, "__name__", "value")
    return convert


def _entry(hint: Any, metavar: str) -> Callable:
    """An argparse type for one KEY=VALUE entry of a map, checked as the map's type."""
    map_hint = _strip(hint)

    def convert(text: str) -> dict:
        key, sep, value = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected {metavar}, got {text!r}")
        try:
            return msgspec.convert({key: value}, map_hint, strict=False, str_keys=True)
        except msgspec.ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{text}: {exc}") from None

    convert.__name__ = "entry"
    return convert


class _MergeDict(argparse.Action):
    """Each KEY=VALUE given adds its entry to the option's map."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), **values})
