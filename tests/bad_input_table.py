"""docs/bad_input.md's tables as data, for the tests that run every row: generate's rows in
test_cli_checks.py, serve's in test_serve_bad_input.py. A cell's `code` is the input or
the answer exactly; an <angle-bracketed name> in it stands for something the test makes
(a checkpoint folder, a file, a long prompt), given to `resolve` as a dict."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "docs" / "bad_input.md"
_CODE = re.compile(r"`([^`]*)`")
_PLACEHOLDER = re.compile(r"(<[^<>]+>)")


def rows(section: str) -> list[list[str]]:
    """The cells of every row of the table under the heading `## section` (no cell holds
    a |)."""
    text = TABLE.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    lines = [line for line in text[start : end if end > 0 else None].splitlines()]
    table = [line for line in lines if line.startswith("|")]
    assert len(table) > 2, f"no table under {section!r}"
    return [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in table[2:]]


def code(cell: str) -> list[str]:
    """The `code` spans of a cell."""
    return _CODE.findall(cell)


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def resolve(text: str, made: dict[str, str]) -> str:
    """text with each <name> replaced by what the test made for it."""
    return _PLACEHOLDER.sub(lambda m: made[m.group(1)], text)


def arguments(cell: str, made: dict[str, str]) -> list[str]:
    """A command line's words: shell words, a <name> one word whatever it holds."""
    words: list[str] = []
    for part in _PLACEHOLDER.split(code(cell)[0]):
        if _PLACEHOLDER.fullmatch(part):
            words.append(made[part])
        else:
            words.extend(shlex.split(part))
    return words
