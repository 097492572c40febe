"""Prompts for `zmqworker generate`: the command line, a file or stdin.

A file holds one prompt per line, or is JSONL (every non-empty line a JSON object) with a
"prompt" (text, or a list of token ids) or "messages" (a conversation: role and content)
in each object. "-" reads stdin the same way.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PromptItem:
    """A completion prompt (text or token ids), or a conversation for the chat template."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None

    def label(self) -> str:
        if self.messages is not None:
            return self.messages[-1]["content"]
        return self.prompt if isinstance(self.prompt, str) else f"{len(self.prompt or [])} tokens"


def read_prompts(positional: list[str], prompts_file: str | None) -> list[PromptItem]:
    items = []
    for text in positional:
        items.extend(_read_source("-") if text == "-" else [PromptItem(prompt=text)])
    if prompts_file is not None:
        items.extend(_read_source(prompts_file))
    if not items:
        raise ValueError("no prompts: give PROMPT arguments, --prompts-file PATH, or - (stdin)")
    return items


def _read_source(source: str) -> list[PromptItem]:
    name = "stdin" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else open(source, encoding="utf-8").read()
    except OSError as exc:
        raise ValueError(f"cannot read prompts from {name}: {exc.strerror}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{name} holds no prompts")
    objects = [_json_object(line) for _, line in lines]
    if not all(o is not None for o in objects):
        return [PromptItem(prompt=line) for _, line in lines]
    return [_item(obj, f"{name} line {n}") for (n, _), obj in zip(lines, objects, strict=True)]


def _json_object(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _item(obj: dict[str, Any], where: str) -> PromptItem:
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f'{where}: give either "prompt" or "messages"')
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "messages" must be a non-empty list')
        return PromptItem(messages=messages)
    prompt = obj["prompt"]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise ValueError(f'{where}: "prompt" must be text or a list of token ids')
    return PromptItem(prompt=prompt)
