"""Prompts as the LLM takes them: text, or token ids, checked against the model."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

# A prompt is text, or token ids, or as vLLM's prompt dicts {"prompt": text} or
# {"prompt_token_ids": ids} (no other key: multi_modal_data and the like are refused).
Prompt = str | Sequence[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """One prompt or several, as a list of text and token ids (vLLM's prompt dicts
    unwrapped; a lone dict is one prompt); an error when there are none. Anything else
    (bytes, an array) is refused: listed, its items would be taken as prompts."""
    if isinstance(prompts, str | Mapping) or is_token_ids(prompts):
        prompts = [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(
            "prompts are a str, a list of token ids, a {'prompt': ...} or "
            "{'prompt_token_ids': ...} dict, or a list of those; got "
            f"{type(prompts).__name__}"
        )
    listed = [unwrap_prompt(p) for p in prompts]
    if not listed:
        raise ValueError("no prompts given")
    return listed


def unwrap_prompt(prompt: Prompt) -> str | Sequence[int]:
    """A vLLM prompt dict's text or token ids; any other prompt as it is."""
    if not isinstance(prompt, Mapping):
        return prompt
    other = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if other:
        raise ValueError(
            f"a prompt dict may hold 'prompt' or 'prompt_token_ids' only: {other[0]!r} "
            "is not supported"
        )
    given = [key for key in PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        raise ValueError("a prompt dict holds one of 'prompt' (text) and 'prompt_token_ids'")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"a prompt dict's 'prompt' is text, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and not isinstance(value, list | tuple):
        raise ValueError(
            f"a prompt dict's 'prompt_token_ids' is a list of ints, got {type(value).__name__}"
        )
    return value


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
    prompt: Prompt,
    tokenizer: Any,
    max_model_len: int,
    vocab_size: int | None,
    keep: int | None = None,
) -> list[int]:
    """The prompt's token ids (text goes through the tokenizer): not empty, within
    max_model_len and the vocabulary; keep: only the last keep of them (kept_tokens),
    cut before the length is checked."""
    prompt = unwrap_prompt(prompt)
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
    if keep is not None:
        token_ids = token_ids[-keep:]
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
        )
    if vocab_size is not None:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return token_ids


def kept_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens vLLM's truncate_prompt_tokens keeps (-1: up to
    max_model_len); None: the whole prompt."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if not 1 <= truncate_prompt_tokens <= max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens must be -1 or from 1 to max_model_len={max_model_len}, "
            f"got {truncate_prompt_tokens}"
        )
    return truncate_prompt_tokens


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of integers (numpy's too), not bools."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(t, Integral) and not isinstance(t, bool) for t in value)
    )


def template_messages(messages: Sequence[Any]) -> list[Any]:
    """A conversation in OpenAI's shape as a chat template takes it, for LLM.chat and the
    server alike (Frontend.chat_prompt; the server's messages are decoded into that shape
    by serve/chat_messages.py): content None (an
    assistant's tool calls only) as "", a list of text parts joined by newlines, the
    "developer" role as "system", a tool call's JSON arguments as an object. The caller's
    messages are not changed; what is not a dict is left for the check to refuse."""
    out: list[Any] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            out.append(message)
            continue
        message = dict(message)
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = "\n".join(_text_part(part, i, j) for j, part in enumerate(content))
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_tool_call(call, i) for call in message["tool_calls"]]
        out.append(message)
    return out


def _text_part(part: Any, i: int, j: int) -> str:
    if (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    ):
        return part["text"]
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"message {i}: content part {j} ({kind!r}) is not supported: text parts only")


def _tool_call(call: Any, i: int) -> Any:
    """The call with its arguments, JSON text as OpenAI sends them, as an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(
            f"message {i}: a tool call's arguments must be a JSON object, got "
            f"{function['arguments']!r:.80}"
        )
    return {**call, "function": {**function, "arguments": arguments}}
