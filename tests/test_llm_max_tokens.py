"""vLLM's max_tokens=None (generate until the context is full) through the LLM on the
tiny model: resolved per prompt by the frontend, so that the wire still carries an int
max_tokens."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from messages import SamplingParams
from messages.sampling import INT32_MAX
from tests.test_engine_e2e import make_llm
from zmqworker.frontend.llm import LLM

MAX_MODEL_LEN = 96  # make_llm's


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with make_llm() as engine:
        yield engine


def prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 300 + 10 for i in range(length)]


def test_max_tokens_none_generates_until_the_context_is_full(llm):
    """Each prompt gets the room its own length leaves, every sample of it (n); min_tokens
    past that room is cut to it."""
    params = SamplingParams(temperature=0.0, max_tokens=None, n=2, min_tokens=50, ignore_eos=True)
    assert params.max_tokens == INT32_MAX  # an int, as the wire's schema says
    outs = llm.generate([prompt(90), prompt(93)], params)
    assert [len(o.token_ids) for o in outs] == [6, 6, 3, 3]
    assert {o.finish_reason for o in outs} == {"length"}


def test_the_wire_carries_each_prompts_room(llm):
    states = llm._new.make([prompt(90), prompt(10)], SamplingParams(max_tokens=None), False)
    assert [s.params.max_tokens for s in states] == [6, 86]
    wire = msgspec.msgpack.encode(states[1].params)
    assert wire == msgspec.msgpack.encode(SamplingParams(max_tokens=86))
    explicit = llm._new.make(prompt(90), SamplingParams(max_tokens=40), False)
    assert explicit[0].params.max_tokens == 40  # a number given is sent as it is


def test_a_prompt_that_fills_the_context_leaves_no_room(llm):
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=None)]
    with pytest.raises(
        ValueError, match=r"prompt 1: the prompt has 96 tokens, all of max_model_len=96"
    ):
        llm.generate([prompt(10), prompt(MAX_MODEL_LEN)], params)


def test_a_sample_whose_seed_would_be_minus_one_stays_seeded(llm: LLM) -> None:
    """Sample i is seeded seed + i; -1 means no seed (vLLM's), so that sample takes seed + n
    rather than turning unseeded."""
    states = llm._new.make([[5, 6, 7]], SamplingParams(seed=-2, n=3, max_tokens=1), False)
    assert [s.params.seed for s in states] == [-2, 1, 0]
    states = llm._new.make([[5, 6, 7]], SamplingParams(seed=7, n=3, max_tokens=1), False)
    assert [s.params.seed for s in states] == [7, 8, 9]
