"""The OpenAI and vLLM request features this server does not implement, in one place: a
request that asks for one is refused with a message that says so. A field here is taken
at its neutral value only (what asks for nothing: null, false, 0, an empty list, or
vLLM's default); a feature that comes removes its row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zmqworker.serve.errors import APIError

Refusals = dict[str, tuple[Callable[[Any], bool], str]]


def _null(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    """null, false, 0, "", [] or {}: none of them asks for anything."""
    return not value


# field: (is its value neutral?, what the refusal says)
UNSUPPORTED: Refusals = {
    "suffix": (_empty, "suffix is not supported: a completion only continues its prompt"),
    "reasoning_effort": (_null, "reasoning_effort is not supported"),
    "verbosity": (_null, "verbosity is not supported"),
    "modalities": (
        lambda v: v in (None, ["text"]),
        'modalities other than ["text"] are not supported',
    ),
    "web_search_options": (_null, "web_search_options is not supported"),
    "functions": (_empty, "functions is not supported: give tools"),
    # "none" calls no function: what leaving it out asks.
    "function_call": (
        lambda v: v in (None, "none"),
        'function_call is not supported: give tool_choice (only "none" is taken)',
    ),
    # vLLM's own.
    "use_beam_search": (_empty, "use_beam_search is not supported: only sampling"),
    "length_penalty": (
        lambda v: v in (None, 1),
        "length_penalty is not supported: it weighs beam search's beams (only 1 is taken)",
    ),
    "priority": (_empty, "priority is not supported: every request has priority 0"),
    "cache_salt": (
        _null,
        "cache_salt is not supported: the prefix cache is shared by every request",
    ),
    "logits_processors": (_empty, "logits_processors is not supported"),
    "return_tokens_as_token_ids": (_empty, "return_tokens_as_token_ids is not supported"),
    "return_token_ids": (_empty, "return_token_ids is not supported"),
    # The structured-output backend is the engine's: xgrammar ("auto" picks it too).
    "guided_decoding_backend": (
        lambda v: v in (None, "auto", "xgrammar"),
        'guided_decoding_backend is not supported: structured outputs use xgrammar (only "auto" '
        'or "xgrammar" is taken)',
    ),
    "guided_whitespace_pattern": (
        _null,
        "guided_whitespace_pattern is not supported: JSON is generated without free whitespace",
    ),
    "kv_transfer_params": (_empty, "kv_transfer_params is not supported"),
    "vllm_xargs": (_empty, "vllm_xargs is not supported"),
    "documents": (_null, "documents is not supported"),
    "chat_template": (
        _null,
        "chat_template is not supported: the model's own template is used",
    ),
}

# Chat's own (completions take echo and best_of).
CHAT_UNSUPPORTED: Refusals = {
    "echo": (_empty, "echo is not supported in chat: a reply does not repeat the last message"),
    "best_of": (
        lambda v: v in (None, 1),
        "best_of is not supported in chat: give n (only 1 is taken)",
    ),
    "mm_processor_kwargs": (_empty, "mm_processor_kwargs is not supported: text models only"),
}

# Inside structured_outputs: whitespace_pattern. (JSON is generated compact, which any
# disable_any_whitespace allows; xgrammar's schemas take no properties they do not name,
# whatever disable_additional_properties says, as vLLM's on xgrammar; there is no backend
# to fall back to, whatever disable_fallback says: those are taken at any value.)
STRUCTURED_UNSUPPORTED: Refusals = {
    "whitespace_pattern": (
        _null,
        "whitespace_pattern is not supported: JSON is generated without free whitespace",
    ),
}

# What a chat response's message holds besides role, content and tool calls, for when it
# is sent back in a conversation as is (the openai client's model_dump()).
MESSAGE_UNSUPPORTED: Refusals = {
    "refusal": (_null, "refusal is not supported: only null"),
    "audio": (_null, "audio is not supported: only null"),
    "function_call": (_null, "function_call is not supported: only null"),
    "annotations": (_empty, "annotations is not supported: only null or []"),
}

# Content part types OpenAI defines besides text, by what they carry.
_PART_KINDS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def refuse_unsupported(request: object, refusals: Refusals = UNSUPPORTED, at: str = "") -> None:
    """An APIError naming the first field of request (at: its path, "messages[0].") that
    asks for what is not supported."""
    for field, (neutral, message) in refusals.items():
        if hasattr(request, field) and not neutral(getattr(request, field)):
            raise APIError(f"{at}{message}", param=f"{at}{field}")


def refuse_spacing(request: Any) -> None:
    """spaces_between_special_tokens=false (vLLM's default is true) changes only text that
    keeps special tokens: with skip_special_tokens (the default) it asks for nothing, as
    in vLLM; with special tokens kept, the tokenizer's decoder writes them as it does."""
    if request.spaces_between_special_tokens is False and request.skip_special_tokens is False:
        raise APIError(
            "spaces_between_special_tokens=false is not supported with "
            "skip_special_tokens=false: special tokens are decoded as the tokenizer writes them",
            param="spaces_between_special_tokens",
        )


def unsupported_part(part_type: str) -> str:
    """The refusal of a message content part that is not text."""
    kind = _PART_KINDS.get(part_type, repr(part_type))
    return f"{kind} content parts are not supported: only text"
