"""Prompts for `zmqworker generate`: the command line, a file or stdin.

A file (or stdin, "-") is JSONL when its first non-empty line starts with "{": then every
non-empty line must be a JSON object with a "prompt" (text, or a list of token ids) or
"messages" (a conversation: role and content), and may set any SamplingParams field for
its own prompt ("max_tokens", "temperature", "stop", ...). Otherwise each non-empty line
is a prompt, as it is. Lines end at "\\n" (a "\\r" before it is dropped); text must be
valid UTF-8. Every prompt is numbered from 0 across all sources, as --json's "index".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec

from messages import SamplingParams
from zmqworker.engine.prompts import check_text

# The sampling fields a JSONL line may set for its prompt, and their types.
# structured_outputs is the run's (--json-schema, --regex: cli/structured.py).
SAMPLING_KEYS = {
    f.name: f.type for f in msgspec.structs.fields(SamplingParams) if f.name != "structured_outputs"
}
PROMPT_KEYS = ("prompt", "messages")


@dataclass(frozen=True)
class PromptItem:
    """A completion prompt (text or token ids), or a conversation for the chat template,
    with the sampling fields its JSONL line sets and where it came from."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # "FILE line N", for prompts read from a file or stdin

    def label(self) -> str:
        if self.messages is not None:
            return str(self.messages[-1].get("content"))
        return self.prompt if isinstance(self.prompt, str) else f"{len(self.prompt or [])} tokens"

    def where(self, index: int) -> str:
        """How an error names this prompt: "prompt 2 (stdin line 3)"."""
        return f"prompt {index}" + (f" ({self.source})" if self.source else "")


def read_prompts(positional: list[str], prompts_file: str | None) -> list[PromptItem]:
    """Every prompt, in order: the arguments (- reads stdin there), then the file."""
    items: list[PromptItem] = []
    for text in positional:
        if text == "-":
            items.extend(_read_source("-", len(items)))
            continue
        where = f"prompt {len(items)}"
        if not text:
            raise ValueError(f"{where} is empty")
        check_text(text, where, from_bytes=True)
        items.append(PromptItem(prompt=text))
    if prompts_file is not None:
        items.extend(_read_source(prompts_file, len(items)))
    if not items:
        raise ValueError("no prompts: give PROMPT arguments, --prompts-file PATH, or - (stdin)")
    return items


def _read_source(source: str, first_index: int) -> list[PromptItem]:
    name = "stdin" if source == "-" else source
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read prompts from {name}: {exc.strerror}") from None
    lines = [
        (n, line.removesuffix(b"\r")) for n, line in enumerate(data.split(b"\n"), 1) if line.strip()
    ]
    if not lines:
        raise ValueError(f"{name} holds no prompts")
    jsonl = lines[0][1].lstrip().startswith(b"{")
    items = []
    for index, (n, line) in enumerate(lines, first_index):
        source_line = f"{name} line {n}"
        where = f"prompt {index} ({source_line})"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where} is not valid UTF-8 text: byte 0x{line[exc.start]:02x} at byte "
                f"{exc.start + 1} of the line"
            ) from None
        items.append(
            _jsonl_item(text, where, source_line)
            if jsonl
            else PromptItem(prompt=text, source=source_line)
        )
    return items


def _jsonl_item(line: str, where: str, source_line: str) -> PromptItem:
    try:
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # msgspec's message names the byte: "JSON is malformed: ... (byte 12)".
        raise ValueError(
            f"{where} is not valid JSON ({exc}); the file is JSONL, as its first line starts "
            'with "{"'
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is not a JSON object; every line of a JSONL file is one")
    for key in obj:
        if key not in PROMPT_KEYS and key not in SAMPLING_KEYS:
            raise ValueError(
                f'{where}: unknown key "{key}": a line takes "prompt" or "messages", and '
                f"sampling fields ({', '.join(SAMPLING_KEYS)})"
            )
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f'{where}: give either "prompt" or "messages"')
    sampling = {}
    for key, value in obj.items():
        if key in SAMPLING_KEYS:
            try:
                # str_keys: JSON's keys are strings (logit_bias maps token ids).
                sampling[key] = msgspec.convert(value, SAMPLING_KEYS[key], str_keys=True)
            except msgspec.ValidationError as exc:
                raise ValueError(f'{where}: "{key}": {exc}') from None
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "messages" must be a non-empty list')
        return PromptItem(messages=messages, sampling=sampling, source=source_line)
    prompt = obj["prompt"]
    is_ids = isinstance(prompt, list) and all(type(t) is int for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise ValueError(f'{where}: "prompt" must be text or a non-empty list of token ids')
    return PromptItem(prompt=prompt, sampling=sampling, source=source_line)
