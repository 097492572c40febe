"""Prompts as the LLM takes them: text, or token ids, checked against the model."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

# A prompt is text, or token ids.
Prompt = str | Sequence[int]


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or several, as a list; an error when there are none. Anything else
    (a dict such as vLLM's {"prompt_token_ids": ...}, bytes, an array) is refused: listed,
    its keys or items would be taken as prompts."""
    if isinstance(prompts, str) or is_token_ids(prompts):
        prompts = [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(
            "prompts are a str, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__}"
        )
    listed = list(prompts)
    if not listed:
        raise ValueError("no prompts given")
    return listed


def check_text(text: str, what: str, from_bytes: bool = False) -> None:
    """A ValueError naming what, if text cannot be encoded as UTF-8: it holds a lone
    surrogate (a JSON "\\udcff" escape). from_bytes: text decoded from bytes with
    surrogateescape (a command line, stdin, a file), whose lone surrogates U+DC80 to
    U+DCFF stand for the bytes that were not UTF-8, and are named as those bytes. No
    tokenizer takes such text and no message carries it: it is refused, not replaced.
    Characters count from 1."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        if from_bytes and 0xDC80 <= code <= 0xDCFF:
            raise ValueError(
                f"{what} is not valid UTF-8 text: byte 0x{code - 0xDC00:02x} at character "
                f"{exc.start + 1}"
            ) from None
        raise ValueError(
            f"{what} is not valid Unicode text: it holds a lone surrogate "
            f"{text[exc.start]!r} at character {exc.start + 1} (text must be encodable as "
            "UTF-8)"
        ) from None


def prompt_token_ids(
    prompt: Prompt, tokenizer: Any, max_model_len: int, vocab_size: int | None
) -> list[int]:
    """The prompt's token ids (text goes through the tokenizer): not empty, within
    max_model_len and the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("the model folder has no tokenizer: give prompts as token ids")
        check_text(prompt, "the prompt")
        token_ids = list(tokenizer.encode(prompt))
    elif is_token_ids(prompt) or (isinstance(prompt, list | tuple) and not prompt):
        token_ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"a prompt is a str or a list of token ids, got {prompt!r:.80}")
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
        )
    if vocab_size is not None:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return token_ids


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of integers (numpy's too), not bools."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(t, Integral) and not isinstance(t, bool) for t in value)
    )
