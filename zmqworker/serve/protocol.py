"""The request bodies of the OpenAI API that the server takes, as msgspec structs: the
body is decoded straight into them (fast enough to hold the event loop only briefly for
the largest body allowed), then check() refuses what no type can say. A field OpenAI
does not define is a 400 that names it; one it defines and this server does not
implement is refused as not supported (unsupported.py) unless it has its neutral value,
or taken and not used where it changes nothing of the output (store, metadata, ...).
top_k, min_p, ignore_eos, stop_token_ids, repetition_penalty, min_tokens, bad_words,
allowed_token_ids, include_stop_str_in_output, skip_special_tokens, add_special_tokens,
request_id (names the response where no X-Request-Id header does), prompt_logprobs,
completions' echo with logprobs (the prompt's positions first, as vLLM's), chat's
add_generation_prompt, continue_final_message and chat_template_kwargs,
structured_outputs and guided_* are vLLM's extensions; its others (use_beam_search,
priority, cache_salt, ...) are refused unless neutral, as OpenAI's unsupported ones are;
model may be left out (the served model). Messages: chat_messages.py; tool calling:
serve/tools.py."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from messages import StructuredOutputsParams
from messages.sampling import INT32_MAX, MAX_N, TokenId
from zmqworker.serve.chat_messages import ChatMessage
from zmqworker.serve.errors import APIError
from zmqworker.serve.request_id import check_request_id
from zmqworker.serve.structured import StructuredFields
from zmqworker.serve.tools import NamedToolChoice, Tool, ToolFields
from zmqworker.serve.unsupported import CHAT_UNSUPPORTED, refuse_spacing, refuse_unsupported

# logprobs and top_logprobs are bounded by the server's --max-logprobs (request_params),
# and by the workers' int32 columns here.
Logprobs = Annotated[int, Meta(ge=0, le=INT32_MAX)]
# The most prompts one completion request may hold: each becomes a request in the engine,
# added on the event loop (OpenAI's bound on the inputs of one embeddings request).
MAX_PROMPTS = 2048

StopString = Annotated[str, Meta(min_length=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value, either way
# A logit_bias key: a token id as JSON writes an integer. Python's int() would also take
# " 5", "05", "+5" and "٥", which are no token ids a client means to write.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")


class StreamOptions(Struct, forbid_unknown_fields=True):
    """OpenAI's, and vLLM's continuous_usage_stats; null is false, as left out (vLLM's:
    {} asks for no usage, as OpenAI's)."""

    include_usage: bool | None = None  # a last chunk with the usage
    continuous_usage_stats: bool | None = None  # with include_usage: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of deltas: none here


class SamplingRequest(StructuredFields, forbid_unknown_fields=True, kw_only=True):
    """What both endpoints take (structured outputs: serve/structured.py)."""

    model: str | None = None  # None: the served model
    temperature: Annotated[float, Meta(ge=0)] | None = None  # vLLM's bound (OpenAI's: 2)
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    bad_words: list[StopString] | None = None
    # Checked with the other token ids (SamplingParams, request_params): a 400 naming one.
    allowed_token_ids: list[int] | None = None
    stream: bool | None = False  # null: false, as OpenAI allows
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None  # choices per prompt
    prompt_logprobs: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None  # -1: refused by name
    add_special_tokens: bool | None = None  # default: true for completions, false for chat
    request_id: str | None = None  # names the response where no X-Request-Id header does
    # vLLM's: keep the prompt's last k tokens (-1: up to max_model_len; engine/prompts.py).
    truncate_prompt_tokens: int | None = None
    # vLLM's, taken where they change nothing of the output (unsupported.py).
    spaces_between_special_tokens: bool | None = None
    # vLLM's, refused unless neutral (unsupported.py).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    priority: int | None = None
    cache_salt: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse what the types cannot: unsupported features, options that need another."""
        refuse_unsupported(self)
        refuse_spacing(self)
        self.structured_params()
        options = self.stream_options
        if options is not None and not self.stream and any(msgspec.structs.astuple(options)):
            raise APIError("stream_options needs stream=true", param="stream_options")
        if self.stream and self.prompt_logprobs not in (None, 0):  # vLLM's refusal
            raise APIError(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
        if self.request_id is not None:
            check_request_id(self.request_id, "request_id")
        self.token_bias()

    def stream_usage(self) -> tuple[bool, bool]:
        """A stream's usage (vLLM's): (a last chunk with it, in every chunk too)."""
        options = self.stream_options or StreamOptions()
        final = bool(options.include_usage)
        return final, final and bool(options.continuous_usage_stats)

    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes."""
        return self.prompt_logprobs

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias by token id; its keys must be token ids written as strings (as
        OpenAI's are), its values within [-100, 100]. The vocabulary's bound is checked
        with the other token ids (request_params)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise APIError(
                    f"logit_bias: key {key!r} is not a token id: keys are token ids (integers "
                    "in [0, vocabulary size)) in plain decimal digits, without sign, spaces "
                    "or leading zeros",
                    param="logit_bias",
                )
            # The length first: int() of thousands of digits is slow, or refused.
            if len(key) > len(str(INT32_MAX)) or int(key) > INT32_MAX:
                raise APIError(
                    f"logit_bias: key {key!r} is not a token id: token ids are integers in "
                    f"[0, vocabulary size), at most {INT32_MAX}",
                    param="logit_bias",
                )
            if not -MAX_BIAS <= value <= MAX_BIAS:
                raise APIError(
                    f"logit_bias: a bias must be in [-100, 100], got {value} for token {key}",
                    param="logit_bias",
                )
            bias[int(key)] = value
        return bias

    def stop_strings(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: str | list[str | int | list[int]]
    max_tokens: Annotated[int, Meta(ge=0)] | None = 16  # 0: with echo, the prompt alone
    logprobs: Logprobs | None = None
    echo: bool | None = False  # with logprobs: the prompt's positions first
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None  # the n best of best_of
    # Not supported unless neutral (unsupported.py).
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        n, best_of = self.n or 1, self.best_of
        if best_of is not None and best_of < n:
            raise APIError(
                f"best_of={best_of} with n={n}: best_of must be at least n", param="best_of"
            )
        if best_of is not None and best_of > n and self.stream:
            raise APIError(
                f"best_of={best_of} with n={n} cannot be streamed: the n best are known only "
                "once every sample has ended",
                param="best_of",
            )
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                "max_tokens must be at least 1, got 0 (0 only with echo: the prompt alone)",
                param="max_tokens",
            )
        self.named_prompts()

    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as vLLM's; the
        engine generates one token, which is not returned."""
        return bool(self.echo) and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        return 1 if self.echo_only() else self.max_tokens

    def engine_prompt_logprobs(self) -> int | None:
        """With echo, the prompt's logprobs are logprobs' (vLLM's)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def with_special_tokens(self) -> bool:
        return self.add_special_tokens is not False  # vLLM's default for completions: true

    def named_prompts(self) -> list[tuple[str, str | list[int]]]:
        """The prompts, one per choice (text, or token ids each at least 0), with the
        param naming each: "prompt", or "prompt[i]" in a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(type(t) is int for t in prompt)):
            named: list[tuple[str, Any]] = [("prompt", prompt)]
        elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            named = [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
        else:
            raise APIError(
                "prompt: expected a text, a list of texts, a list of token ids or a list of "
                "token id lists, not a mix",
                param="prompt",
            )
        if not named or any(len(p) == 0 for _, p in named):
            raise APIError("prompt is empty", param="prompt")
        if len(named) > MAX_PROMPTS:
            raise APIError(
                f"prompt: {len(named)} prompts in one request, more than the {MAX_PROMPTS} "
                "this server takes",
                param="prompt",
            )
        for name, p in named:
            if isinstance(p, list) and min(p) < 0:
                at = next(k for k, t in enumerate(p) if t < 0)
                raise APIError(
                    f"{name}: token ids must be >= 0, got {p[at]} at index {at}", param=name
                )
        return named


class ChatCompletionRequest(SamplingRequest, ToolFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, that change nothing of the output here: taken, and not used.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: Any = None
    # OpenAI's, refused unless neutral (unsupported.py).
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's, for chat, refused unless neutral (unsupported.py).
    documents: list[Any] | None = None
    chat_template: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: with no reasoning parser, nothing to include or leave out.
    include_reasoning: bool | None = None

    def check(self) -> None:
        self.check_tools()
        structured = super().structured_field()
        if self.forced() and structured is not None:
            choice = self.choice()
            named = choice if isinstance(choice, str) else f"naming {choice.function.name!r}"
            raise APIError(
                f"tool_choice {named} constrains the output itself: it cannot be combined "
                f"with {structured}",
                param=structured,
            )
        super().check()
        refuse_unsupported(self, CHAT_UNSUPPORTED)
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")
        if self.top_logprobs and not self.logprobs:  # vLLM's: 0 asks for nothing
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured_params(self) -> StructuredOutputsParams | None:
        """A forcing tool_choice's constraint (serve/tools.py), else the request's own."""
        return self.tool_constraint() or super().structured_params()

    def structured_field(self) -> str | None:
        return "tools" if self.forced() else super().structured_field()
