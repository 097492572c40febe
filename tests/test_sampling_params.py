"""SamplingParams' ranges are msgspec Meta constraints: checked when the struct is made
and when a message decodes, the field named either way."""

from __future__ import annotations

import msgspec
import pytest

from messages import SamplingParams
from messages import examples as ex
from messages.codec import Decoder, Encoder, ProtocolError


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, r"Expected `float` >= 0.0 - at `\$.temperature`"),
        ({"top_p": 0.0}, r"Expected `float` > 0.0 - at `\$.top_p`"),
        ({"top_p": 1.5}, r"Expected `float` <= 1.0 - at `\$.top_p`"),
        ({"min_p": -0.1}, r"Expected `float` >= 0.0 - at `\$.min_p`"),
        ({"top_k": -2}, r"Expected `int` >= -1 - at `\$.top_k`"),
        ({"max_tokens": 0}, r"Expected `int` >= 1 - at `\$.max_tokens`"),
        ({"stop": ["ok", ""]}, r"Expected `str` of length >= 1 - at `\$.stop\[1\]`"),
        ({"stop_token_ids": [-1]}, r"Expected `int` >= 0 - at `\$.stop_token_ids\[0\]`"),
        ({"logprobs": -1}, r"Expected `int` >= 0 - at `\$.logprobs`"),
        ({"temperature": float("nan")}, r"Expected `float` >= 0.0 - at `\$.temperature`"),
        ({"top_p": float("nan")}, r"Expected `float` > 0.0 - at `\$.top_p`"),
        ({"temperature": float("inf")}, r"temperature must be finite"),
        # Finite in Python, inf in the workers' float32 columns.
        ({"temperature": 1e39}, r"temperature must be finite in float32 .*, got 1e\+39"),
        ({"repetition_penalty": 1e39}, r"repetition_penalty must be finite in float32"),
        ({"temperature": "hot"}, r"Expected `float`, got `str` - at `\$.temperature`"),
        ({"seed": 2**63}, r"Expected `int` <= 9223372036854775807 - at `\$.seed`"),
        # The workers hold these in int32 columns.
        ({"top_k": 2**31}, r"Expected `int` <= 2147483647 - at `\$.top_k`"),
        ({"stop_token_ids": [2**31]}, r"<= 2147483647 - at `\$.stop_token_ids\[0\]`"),
        ({"logit_bias": {2**31: 1.0}}, r"<= 2147483647 - at `key` in `\$.logit_bias`"),
        ({"min_tokens": 2**31, "max_tokens": 2**32}, r"<= 2147483647 - at `\$.min_tokens`"),
        ({"logprobs": 2**31}, r"Expected `int` <= 2147483647 - at `\$.logprobs`"),
    ],
)
def test_a_value_out_of_range_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    # A message carrying it does not decode either.
    raw = msgspec.msgpack.encode({"type": "SamplingParams", **fields})
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def test_values_in_range_round_trip():
    params = SamplingParams(
        temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0, seed=-3, max_tokens=1,
        stop=["\n"], stop_token_ids=[0], ignore_eos=True, logprobs=0,
    )  # fmt: skip
    params.validate()
    raw = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(raw, type=SamplingParams) == params
    assert msgspec.structs.replace(params, logprobs=20).logprobs == 20
    with pytest.raises(ValueError, match="logprobs"):
        msgspec.structs.replace(params, logprobs=-1)
    SamplingParams(temperature=3.4e38, repetition_penalty=3.4e38)  # finite in float32


def test_end_of_sequence_ids_past_int32_do_not_decode():
    """An engine core's stop table and a worker's rows hold them as int32."""
    request = ex.EXAMPLES["engine_core_request"]()
    step = ex.prefill_step(num_reqs=1, prompt_len=4)
    new = msgspec.structs.replace(step.scheduled_new_reqs[0], eos_token_ids=[2**31])
    for message in (
        msgspec.structs.replace(request, eos_token_ids=[2**31]),
        ex.execute_model_request(msgspec.structs.replace(step, scheduled_new_reqs=[new])),
    ):
        with pytest.raises(ProtocolError, match=r"<= 2147483647 - at .*eos_token_ids"):
            Decoder().decode(Encoder().encode(message))
