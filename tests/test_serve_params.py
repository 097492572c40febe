"""What a request's body becomes before anything runs, without a model: each prompt's
max_tokens (the room its own length leaves, and the model's generation_config bound, as
vLLM's), the legacy logprobs' top entries with the sampled token, structured-output
constraints that are empty but set, and a chat template that refuses a conversation."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from messages import SamplingParams, StructuredOutputsParams
from tests.engine_helpers import byte_level_tokenizer
from zmqworker.engine.model_folder import TextSide
from zmqworker.frontend.frontend import Frontend
from zmqworker.frontend.outputs import PositionLogprobs, TokenLogprob
from zmqworker.serve.body import decode_body
from zmqworker.serve.completions import _logprobs, prompt_params
from zmqworker.serve.errors import APIError
from zmqworker.serve.protocol import CompletionRequest


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
