"""Code written for vLLM's LLM API, run here: its result shape, prompt dicts, messages in
OpenAI's shape, SamplingParams' lenient spellings and the LLM's constructor spellings
(unit tests; the LLM's own are in test_llm_api.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from messages import SamplingParams
from messages.sampling import INT32_MAX
from zmqworker.engine.prompts import prompt_list, template_messages
from zmqworker.frontend.llm import OPTION_TYPES
from zmqworker.frontend.llm_args import check_args, vllm_options
from zmqworker.frontend.outputs import (
    PositionLogprobs,
    RequestOutput,
    RequestTimings,
    TokenLogprob,
)


def output(logprobs: list[PositionLogprobs] | None) -> RequestOutput:
    return RequestOutput(
        "r", "Hi", [1, 2], " a b", [5, 6], True, "length", None, RequestTimings(0, 0, 0),
        logprobs=logprobs, index=3,
    )  # fmt: skip


def test_request_output_has_vllms_outputs_view_and_cumulative_logprob():
    positions = [
        PositionLogprobs(TokenLogprob(t, lp, None), 1, []) for t, lp in ((5, -0.5), (6, -1.25))
    ]
    out = output(positions)
    [completion] = out.outputs
    assert completion.text == out.text and completion.token_ids == out.token_ids
    assert completion.index == 3 and completion.finish_reason == "length"
    assert completion.logprobs is positions and completion.stop_reason is None
    assert out.cumulative_logprob == completion.cumulative_logprob == -1.75
    assert output(None).cumulative_logprob is None  # no logprobs asked for: as vLLM


def test_prompt_dicts_are_prompts():
    assert prompt_list({"prompt": "Hi"}) == ["Hi"]
    assert prompt_list([{"prompt_token_ids": [5, 6]}, "x"]) == [[5, 6], "x"]
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        prompt_list({"prompt": "Hi", "multi_modal_data": {"image": None}})
    with pytest.raises(ValueError, match="one of 'prompt'"):
        prompt_list({"prompt": "Hi", "prompt_token_ids": [1]})


def test_openai_shaped_messages_become_template_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    given = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    system, user, assistant = template_messages(given)
    assert system == {"role": "system", "content": "Be brief."}
    assert user == {"role": "user", "content": "a\nb"}
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {
        "x": 1
    }
    assert given[2]["content"] is None and call["function"]["arguments"] == '{"x": 1}'
    with pytest.raises(ValueError, match="message 0: content part 0 \\('image_url'\\)"):
        template_messages([{"role": "user", "content": [{"type": "image_url"}]}])


def test_sampling_params_take_vllms_spellings():
    params = SamplingParams(
        stop="\n", stop_token_ids=None, bad_words=None, logit_bias=None,
        seed=np.int64(7), max_tokens=np.int32(5), temperature=np.float32(0.5), top_k=np.int64(3),
    )  # fmt: skip
    assert params == SamplingParams(stop=["\n"], seed=7, max_tokens=5, temperature=0.5, top_k=3)
    assert type(params.seed) is int and type(params.temperature) is float
    assert SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids == [4]
    encoded = msgspec.msgpack.encode(params)  # the wire is unchanged
    assert msgspec.msgpack.decode(encoded, type=SamplingParams) == params
    # max_tokens=None: until the context is full, marked with an int the frontend
    # resolves per prompt (test_llm_max_tokens.py); the wire's max_tokens stays an int.
    assert SamplingParams(max_tokens=None).max_tokens == INT32_MAX
    # seed=-1: vLLM's "no seed" (clients send it for random samples), from any sender.
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=np.int64(-1)).seed is None
    wire = msgspec.msgpack.encode({"type": "SamplingParams", "seed": -1})
    assert msgspec.msgpack.decode(wire, type=SamplingParams).seed is None
    assert SamplingParams(seed=-2).seed == -2
    with pytest.raises(TypeError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=True)  # a vLLM field not taken


def test_llm_arguments_take_vllms_spellings(tmp_path):
    torch = pytest.importorskip("torch")
    base = {"model": str(tmp_path), "dtype": "auto", "seed": 0}
    for given, dtype in (("half", "float16"), ("float", "float32"), (torch.bfloat16, "bfloat16")):
        assert vllm_options({**base, "dtype": given}, {})["dtype"] == dtype
    assert vllm_options({**base, "seed": None}, {})["seed"] == 0
    neutral = {"trust_remote_code": False, "kv_cache_dtype": "auto", "swap_space": 0,
               "disable_log_stats": True, "tokenizer": str(tmp_path / ".")}  # fmt: skip
    assert vllm_options(base, neutral) == base
    for name, value in (("trust_remote_code", True), ("kv_cache_dtype", "fp8"),
                        ("swap_space", 4), ("tokenizer", "/elsewhere")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name}=.* is not supported: "):
            vllm_options(base, {name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'quantization'"):
        vllm_options(base, {"quantization": "awq"})
    with pytest.raises(ValueError, match="dtype='double'.*one of 'float32', 'bfloat16'"):
        check_args(OPTION_TYPES, {"dtype": "double"})
