"""What a request's body becomes before anything runs, without a model: each prompt's
max_tokens (the room its own length leaves, and the model's generation_config bound, as
vLLM's), the legacy logprobs' top entries with the sampled token, structured-output
constraints that are empty but set, a chat template that refuses a conversation; and
what vLLM takes or refuses: add_special_tokens, truncate_prompt_tokens, echo's logprobs,
stream_options, the bounds of temperature and logprobs, an assistant's reasoning."""

from __future__ import annotations

import json
from typing import Any, cast

import msgspec
import pytest

from messages import SamplingParams, StructuredOutputsParams
from tests.engine_helpers import byte_level_tokenizer
from zmqworker.engine.model_folder import TextSide
from zmqworker.engine.prompts import prompt_token_ids
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, RequestOutput, RequestTimings, TokenLogprob
from zmqworker.serve.body import decode_body
from zmqworker.serve.chat import _prompt as _chat_prompt
from zmqworker.serve.chat_messages import ChatMessage
from zmqworker.serve.completions import _choice_logprobs, _Echo, _encode, _logprobs, prompt_params
from zmqworker.serve.errors import APIError
from zmqworker.serve.protocol import ChatCompletionRequest, CompletionRequest


class StandIn:
    """What the sampling params ask of a Frontend."""

    tokenizer = None
    vocab_size = 1000
    max_logprobs = 20

    def __init__(self, max_model_len: int, max_new_tokens: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.max_new_tokens = max_new_tokens

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_new_tokens or 16)


def limits(body: dict[str, Any], lengths: list[int], **llm: Any) -> list[int]:
    request = decode_body(json_bytes({"model": "m", "prompt": "x", **body}), CompletionRequest)
    prompts = [[1] * n for n in lengths]
    llm_ = cast(Frontend, StandIn(**llm))
    return [p.max_tokens for p in prompt_params(llm_, request, prompts)]


def json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


def test_each_prompt_without_max_tokens_gets_the_room_its_own_length_leaves():
    """Every prompt had the room the longest left (null: completions' default is 16)."""
    assert limits({"max_tokens": None}, [1, 91], max_model_len=128) == [127, 37]
    assert limits({"max_tokens": 20}, [1, 91], max_model_len=128) == [20, 20]
    with pytest.raises(APIError, match="you requested 129 tokens \\(91 in the prompt, 38"):
        limits({"max_tokens": 38}, [1, 91], max_model_len=128)
    with pytest.raises(APIError, match="you requested 129 tokens \\(128 in the prompt, 1 "):
        limits({"max_tokens": None}, [128], max_model_len=128)


def test_the_model_s_max_new_tokens_bounds_max_tokens_as_vllm_s():
    """generation_config.json's max_new_tokens was left out where a request set none."""
    assert limits({"max_tokens": None}, [10], max_model_len=4096, max_new_tokens=32) == [32]
    assert limits({"max_tokens": 100}, [10], max_model_len=4096, max_new_tokens=32) == [32]
    assert limits({"max_tokens": None}, [4090], max_model_len=4096, max_new_tokens=32) == [6]


def test_legacy_top_logprobs_hold_the_sampled_token_first():
    """OpenAI's and vLLM's: up to n + 1 entries; logprobs=0 gave {} at every position."""

    def at(token: str, logprob: float) -> TokenLogprob:
        return TokenLogprob(0, logprob, token)

    greedy = PositionLogprobs(at(" a", -0.1), 1, [at(" a", -0.1), at(" b", -2.5)])
    sampled = PositionLogprobs(at(" c", -3.0), 4, [at(" a", -0.2)])
    alone = PositionLogprobs(at(" d", -1.0), 2, [])
    tops = _logprobs([greedy, sampled, alone])["top_logprobs"]
    assert tops == [{" a": -0.1, " b": -2.5}, {" c": -3.0, " a": -0.2}, {" d": -1.0}]
    assert list(tops[1]) == [" c", " a"]


@pytest.mark.parametrize(
    "structured",
    [{"json": {}}, {"json": {}, "json_object": False}, {"json_object": True}],
)
def test_a_constraint_that_is_set_but_empty_counts(structured):
    """{"json": {}} (any JSON) was dropped as falsy, and refused as no constraint."""
    body = {"model": "m", "prompt": "x", "structured_outputs": structured}
    request = decode_body(json_bytes(body), CompletionRequest)
    expected = {k: v for k, v in structured.items() if v is not False}
    assert request.structured_params() == StructuredOutputsParams(**expected)


def test_a_chat_template_that_refuses_a_conversation_is_the_request_s_400():
    """Templates raise_exception on roles that do not alternate: that came back as a 500."""
    tok = byte_level_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1]"
        ".role %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    texts = TextSide(tok, SamplingParams(), frozenset())
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="the chat template: TemplateError: Conversation roles"):
        texts.chat_prompt(twice)
    assert texts.chat_prompt(twice[:1])  # one message: the template takes it


class BosTokenizer:
    """A tokenizer that puts a BOS (id 1) before a text unless told not to."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join("<s>" if i == 1 else chr(i) for i in ids)


class Encoding(StandIn):
    """What _encode asks of a Frontend: the tokenizer, and the prompt checks."""

    tokenizer = BosTokenizer()

    def encode(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.max_model_len, None, keep)

    def chat_prompt(self, messages: list[dict], **options: Any) -> str:
        return "".join(m["content"] for m in messages)


def test_add_special_tokens_false_reaches_the_tokenizer():
    """vLLM's add_special_tokens (completions: default true) was refused as unknown."""
    llm = cast(Frontend, Encoding(512))
    for extra, expected in [({}, [1, 72, 105]), ({"add_special_tokens": False}, [72, 105])]:
        request = decode_body(json_bytes({"prompt": "Hi", **extra}), CompletionRequest)
        assert _encode(llm, request)[0] == [expected]
    echoed = decode_body(
        json_bytes({"prompt": [1, 72], "echo": True, "logprobs": 0}), CompletionRequest
    )
    assert _encode(llm, echoed)[1][0].text == "<s>H" and _encode(llm, echoed)[1][0].first == "<s>"


def test_truncate_prompt_tokens_keeps_a_prompt_s_last_tokens():
    """vLLM's truncate_prompt_tokens (-1: up to max_model_len), cut before the length is
    checked, in both endpoints. It was refused."""
    llm = cast(Frontend, Encoding(8))

    def encoded(**body: Any) -> tuple[list[list[int]], list[_Echo]]:
        body = {"prompt": list(range(10, 22)), **body}
        return _encode(llm, decode_body(json_bytes(body), CompletionRequest))

    assert encoded(truncate_prompt_tokens=3)[0] == [[19, 20, 21]]
    assert encoded(truncate_prompt_tokens=-1)[0] == [list(range(14, 22))]
    prompts, echoes = encoded(prompt="Hello", truncate_prompt_tokens=2, echo=True)
    assert prompts == [[108, 111]] and echoes[0].text == "Hello"  # the text given, as vLLM's
    assert encoded(prompt="Hi", truncate_prompt_tokens=5, echo=True)[1][0].text == "Hi"
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "truncate_prompt_tokens": 4}
    assert _chat_prompt(llm, decode_body(json_bytes(chat), ChatCompletionRequest)) == [
        ord(c) for c in "here"
    ]
    with pytest.raises(APIError, match="the prompt has 12 tokens") as caught:
        encoded()
    assert caught.value.param == "prompt"
    for bad in (0, -2, 9):
        with pytest.raises(APIError, match=f"-1 or from 1 to max_model_len=8, got {bad}") as caught:
            encoded(truncate_prompt_tokens=bad)
        assert caught.value.param == "truncate_prompt_tokens"
        with pytest.raises(APIError) as caught:
            _chat_prompt(llm, decode_body(json_bytes({**chat, "truncate_prompt_tokens": bad}),
                                          ChatCompletionRequest))  # fmt: skip
        assert caught.value.param == "truncate_prompt_tokens"


def test_echo_puts_the_prompt_s_positions_first_the_first_without_logprobs():
    """lm-eval-harness's loglikelihood: echo with logprobs (refused), the prompt's
    positions first, the first with null logprob and top_logprobs, as vLLM's."""

    def at(token: str, logprob: float) -> TokenLogprob:
        return TokenLogprob(0, logprob, token)

    prompt = [None, PositionLogprobs(at(" b", -2.0), 3, [at(" x", -0.5), at(" y", -1.0)])]
    generated = [PositionLogprobs(at(" c", -0.1), 1, [at(" c", -0.1)])]
    timings = RequestTimings(0, 0, 0)
    out = RequestOutput("r", None, [5, 6], " c", [7], True, "length", None, timings,
                        logprobs=generated, prompt_logprobs=prompt)  # fmt: skip
    body = decode_body(
        json_bytes({"prompt": "a b", "echo": True, "logprobs": 1}), CompletionRequest
    )
    assert body.engine_prompt_logprobs() == 1 and body.engine_max_tokens() == 16
    whole = _choice_logprobs(body, out, _Echo("a b", "a"), 0, 0)
    assert whole == {
        "tokens": ["a", " b", " c"],
        "token_logprobs": [None, -2.0, -0.1],
        "top_logprobs": [None, {" b": -2.0, " x": -0.5}, {" c": -0.1}],  # at most 1 other
        "text_offset": [0, 1, 3],
    }
    alone = decode_body(
        json_bytes({"prompt": "a b", "echo": True, "logprobs": 1, "max_tokens": 0}),
        CompletionRequest,
    )
    assert alone.echo_only() and alone.engine_max_tokens() == 1  # one token, not returned
    assert _choice_logprobs(alone, out, _Echo("a b", "a"), 0, 0)["tokens"] == ["a", " b"]
    with pytest.raises(APIError, match="max_tokens must be at least 1, got 0") as caught:
        decode_body(json_bytes({"prompt": "a", "max_tokens": 0}), CompletionRequest)
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("options", "usage"),
    [
        (None, (False, False)),
        ({}, (False, False)),  # vLLM's (since its #36379) and OpenAI's: no usage asked
        ({"include_usage": None}, (False, False)),
        ({"continuous_usage_stats": False}, (False, False)),
        ({"continuous_usage_stats": True}, (False, False)),  # only with include_usage
        ({"include_usage": True}, (True, False)),
        ({"include_usage": True, "continuous_usage_stats": True}, (True, True)),
    ],
)
def test_stream_options_as_vllm_reads_them(options, usage):
    body = {"prompt": "x", "stream": True, "stream_options": options}
    assert decode_body(json_bytes(body), CompletionRequest).stream_usage() == usage


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": 2.5},  # vLLM: temperature >= 0 only
        {"prompt": "x", "logprobs": 30},  # --max-logprobs bounds it, not the schema
        {"prompt": "x", "prompt_logprobs": 0, "stream": True},  # vLLM refuses > 0 only
        {"prompt": "x", "stream": False, "stream_options": {}},  # vLLM: only a non-empty one
        {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 1},
        {"prompt": "x", "echo": True, "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 0},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": True},
    ],
)
def test_what_vllm_takes_is_taken(body):
    kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
    decode_body(json_bytes(body), kind)  # no model: the served one


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 1}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"},
         "tool_choice"),  # vLLM refuses tools [] itself
        ({"prompt": "x", "request_id": "two words"}, "request_id"),
    ],
)  # fmt: skip
def test_what_vllm_refuses_is_refused(body, param):
    kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
    with pytest.raises(APIError) as caught:
        decode_body(json_bytes(body), kind)
    assert caught.value.param == param


def test_an_assistant_s_reasoning_reaches_the_template_as_vllm_s_does():
    """reasoning_content / reasoning on an assistant message was refused as unknown."""
    for field in ("reasoning", "reasoning_content"):
        message = msgspec.convert(
            {"role": "assistant", "content": "Hi", field: "Thought."}, ChatMessage
        )
        message.check("messages[1]")
        made = message.as_openai_message()
        assert made["reasoning"] == made["reasoning_content"] == "Thought."
    user = msgspec.convert({"role": "user", "content": "Hi", "reasoning": "x"}, ChatMessage)
    with pytest.raises(APIError, match="only an assistant message carries reasoning"):
        user.check("messages[0]")
    null = msgspec.convert({"role": "assistant", "content": "Hi", "reasoning": None}, ChatMessage)
    assert "reasoning" not in null.as_openai_message()


@pytest.mark.parametrize("extra", [{}, {"include_stop_str_in_output": True}])
def test_stop_strings_without_a_tokenizer_are_the_request_s_400(extra: dict[str, Any]):
    """Matched in the detokenized text, which a model without a tokenizer has none of: a
    400 naming stop, before anything runs (a 500 when a request's state refused it)."""
    with pytest.raises(APIError) as caught:
        limits({"stop": ["x"], **extra}, [3], max_model_len=128)
    assert (caught.value.status, caught.value.param) == (400, "stop")
    assert "stop strings need the model's tokenizer" in caught.value.message
    assert limits({"stop_token_ids": [5]}, [3], max_model_len=128) == [16]
