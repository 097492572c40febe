"""POST /tokenize and POST /detokenize, vLLM's shapes: the model's tokenizer as the
server uses it, without generating. The tokenizer lives in the API server process: no
engine core is asked, so these answer while the engine cores sleep.

    /tokenize    {"model", "prompt", "add_special_tokens", "return_token_strs"} or
                 {"model", "messages", "tools", "add_generation_prompt",
                 "continue_final_message", "chat_template_kwargs", "add_special_tokens",
                 "return_token_strs"} -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model", "tokens"} -> {"prompt"}

model may be left out (the served model). Messages go through the chat template as a
chat completion's do, so count is its usage.prompt_tokens with the same options. A
prompt longer than the model is tokenized all the same: count and max_model_len let the
client see that it would be refused."""

from __future__ import annotations

import re
from typing import Annotated, Any

from msgspec import Meta, Struct

from zmqworker.engine.prompts import check_text
from zmqworker.frontend.frontend import Frontend
from zmqworker.serve.chat_messages import ChatMessage
from zmqworker.serve.errors import APIError
from zmqworker.serve.protocol import TokenId
from zmqworker.serve.tools import Tool, check_tools, template_tools

# What only messages take; a prompt with one is refused, naming it.
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """A prompt, or messages through the chat template (exactly one of them)."""

    model: str | None = None  # None: the served model
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[Tool] | None = None  # messages only: the chat template writes them out
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None  # messages only; default false
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    # Default: true for a prompt, false for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None  # each token's string, as the tokenizer has it

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt or messages, not both or neither", param="prompt")
        if self.messages is None:
            for name in _CHAT_ONLY:
                if getattr(self, name) is not None:
                    raise APIError(f"{name} applies to messages, not to a prompt", param=name)
            return
        check_tools(self.tools)
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None  # None: the served model
    tokens: list[TokenId]  # within the vocabulary: checked against the model's


def tokenize(llm: Frontend, body: TokenizeRequest) -> dict[str, Any]:
    """The answer to /tokenize (text work: in the text pool)."""
    tokenizer = _tokenizer(llm)
    if body.messages is not None:
        messages = [m.as_openai_message() for m in body.messages]
        try:
            tokens = llm.chat_prompt(
                messages,
                add_generation_prompt=body.add_generation_prompt is not False,
                add_special_tokens=body.add_special_tokens is True,
                continue_final_message=body.continue_final_message is True,
                chat_template_kwargs=body.chat_template_kwargs,
                tools=template_tools(body.tools),
            )
        except ValueError as exc:
            named = re.match(r"\w+", str(exc))
            option = named.group() if named else None
            param = option if option in _CHAT_ONLY else "messages"
            raise APIError.from_value_error(exc, param=param) from None
    else:
        assert body.prompt is not None
        try:
            check_text(body.prompt, "prompt")
        except ValueError as exc:
            raise APIError(str(exc), param="prompt") from None
        add_special = body.add_special_tokens is not False
        tokens = list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
    strings = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {
        "count": len(tokens),
        "max_model_len": llm.max_model_len,
        "tokens": tokens,
        "token_strs": strings,
    }


def detokenize(llm: Frontend, body: DetokenizeRequest) -> dict[str, str]:
    """The answer to /detokenize: the tokens' text, special tokens included (text work:
    in the text pool)."""
    tokenizer = _tokenizer(llm)
    vocab_size = llm.vocab_size if llm.vocab_size is not None else len(tokenizer)
    for i, token in enumerate(body.tokens):
        if token >= vocab_size:
            raise APIError(
                f"tokens[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})",
                param=f"tokens[{i}]",
            )
    return {"prompt": tokenizer.decode(body.tokens)}


def _tokenizer(llm: Frontend) -> Any:
    if llm.tokenizer is None:
        raise APIError("the model folder has no tokenizer: the server cannot tokenize text")
    return llm.tokenizer
