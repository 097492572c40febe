"""`zmqworker generate`'s structured-output options: --json-schema FILE, --regex, --choice
and --grammar FILE, at most one, into SamplingParams.structured_outputs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

FLAG = "--json-schema/--regex/--choice/--grammar"


def add_structured_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (at most one)")
    group.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON that this schema validates"
    )
    group.add_argument("--regex", metavar="REGEX", help="the output matches this regex")
    group.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these; repeat"
    )
    group.add_argument(
        "--grammar", metavar="FILE", help="the output follows this EBNF grammar (rule root)"
    )


def structured_option(args: argparse.Namespace) -> dict[str, Any]:
    """{"structured_outputs": the constraint} when one was given, else {}; a ValueError
    names the option that is wrong."""
    from messages import StructuredOutputsParams

    given: dict[str, Any] = {}
    if args.json_schema is not None:
        given["json"] = _read(args.json_schema, "--json-schema")
    if args.regex is not None:
        given["regex"] = args.regex
    if args.choice is not None:
        given["choice"] = args.choice
    if args.grammar is not None:
        given["grammar"] = _read(args.grammar, "--grammar")
    if not given:
        return {}
    if len(given) > 1:
        raise ValueError(f"give one of {FLAG}, not several")
    try:
        return {"structured_outputs": StructuredOutputsParams(**given)}
    except ValueError as exc:  # it names the field (structured_outputs.json), not the flag
        raise ValueError(f"{_FLAGS[next(iter(given))]}: {exc}") from None


_FLAGS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{flag}: {path} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at byte "
            f"{exc.start + 1}"
        ) from None
