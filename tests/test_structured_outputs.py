"""Structured outputs through LLM on the embedded model, in the layout that stresses the
engine side most: two pipeline stages (the bitmask goes to the stage that samples, steps
in flight hold other requests, no async scheduling) and a KV cache small enough that
requests are preempted and recomputed (their matchers must not advance twice). Every
output parses and validates; a bad constraint is a ValueError before anything runs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from messages import SamplingParams, StructuredOutputsParams
from tests.test_readme import require_embedded_model
from zmqworker.frontend.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}
# SmolLM2-135M: 30 layers of 3 KV heads of 64, float32; a stage holds 15 of them.
BLOCK_BYTES_PER_STAGE = 15 * 2 * 3 * 64 * 4 * 16
# max_model_len's: four 59-token prompts take all 16 blocks, so the first decode to need
# a fifth block preempts (every output is longer than the 5 tokens left in its last).
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def llm():
    require_embedded_model()
    with LLM(
        pipeline_parallel_size=2,
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES_PER_STAGE,
    ) as llm:
        yield llm


def constrained(seed: int, max_tokens: int = 64, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def test_schema_outputs_validate_through_preemption_on_two_stages(llm):
    story = "A family keeps several pets at home, each with a name and a few tags. "
    # Five: four fill the cache, the fifth waits for blocks.
    prompts = [f"{story * 3}Describe pet number {i} as JSON:" for i in range(5)]
    params = [constrained(i, json=SCHEMA) for i in range(5)]
    before = llm.stats().num_preemptions
    outputs = llm.generate(prompts, params)
    assert llm.stats().num_preemptions > before, "the KV cache was meant to preempt some"
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_regex_grammar_and_json_object(llm):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    outputs = llm.generate(
        ["Pick a color:", "A date:", "Answer:", "Any JSON:"],
        [
            constrained(1, choice=["red", "green", "blue"]),
            constrained(2, regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"),
            constrained(3, grammar=grammar),
            constrained(4, max_tokens=80, json_object=True),
        ],
    )
    color, date, answer, anything = outputs
    assert color.text in ("red", "green", "blue")
    assert len(date.text) == 10 and date.text.startswith("20")
    assert answer.text in ("The answer is yes.", "The answer is no.")
    assert all(o.finish_reason == "stop" for o in (color, date, answer))
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.text), dict)


def test_a_cut_output_says_length(llm):
    (out,) = llm.generate(["JSON:"], [constrained(5, max_tokens=3, json=SCHEMA)])
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"name"'[: len(out.text)])


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ({"json": {"type": "object", "properties": 3}}, "structured_outputs.json is invalid"),
        ({"regex": "a(b"}, "structured_outputs.regex is invalid"),
        ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar is invalid"),
    ],
)
def test_a_bad_constraint_is_refused_before_anything_runs(llm, kind, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["ok", "bad"], [SamplingParams(max_tokens=2), constrained(0, **kind)])
    assert llm.stats().num_running == 0


def test_params_name_what_is_wrong():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=1, structured_outputs=StructuredOutputsParams(regex="a"))
