"""allowed_token_ids through LLM, the reference engine and real worker processes on the
tiny model: greedy tokens equal transformers' generate with every other token suppressed,
in a batch beside requests without a mask; seeded samples (n=2) draw only allowed tokens;
logit_bias and min_tokens compose with it; bad ids are refused before anything runs."""

from __future__ import annotations

import pytest
import torch
import transformers

from messages import SamplingParams
from tests.test_engine_e2e import PROMPTS, hf_greedy, make_llm
from tests.test_penalties_e2e import hf_tokens
from zmqworker.frontend.llm import LLM

VOCAB = 320  # the tiny model's (tests/test_engine_e2e.py)


class OnlyAllowed(transformers.LogitsProcessor):
    """vLLM's allowed_token_ids: every other token's logit to -inf."""

    def __init__(self, allowed: list[int]) -> None:
        self.banned = torch.ones(VOCAB, dtype=torch.bool)
        self.banned[allowed] = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.banned, -torch.inf)


def hf_allowed_tokens(prompt: list[int], params: SamplingParams, eos: frozenset[int]) -> list[int]:
    """transformers' greedy tokens under params' mask and its other processors."""
    assert params.allowed_token_ids is not None
    return hf_tokens(prompt, params, eos, [OnlyAllowed(params.allowed_token_ids)])


@pytest.fixture(scope="module")
def llm():
    with make_llm() as engine:
        yield engine


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **kw)


def test_greedy_takes_the_likeliest_allowed_token_beside_requests_without_a_mask(llm):
    free = hf_greedy(tuple(PROMPTS[0]), 10)
    allowed = sorted({*free[1::2], 3, 250, VOCAB - 1})  # every other free choice is gone
    params = [greedy(allowed_token_ids=allowed), greedy(), greedy(allowed_token_ids=[77])]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params)
    assert outs[0].token_ids == hf_allowed_tokens(PROMPTS[0], params[0], llm.eos_token_ids)
    assert set(outs[0].token_ids) <= set(allowed) and outs[0].token_ids != free
    assert outs[1].token_ids == hf_greedy(tuple(PROMPTS[1]), 10)
    assert outs[2].token_ids == [77] * 10


def test_seeded_samples_draw_only_allowed_tokens(llm):
    allowed = [4, 9, 60, 61, 200]
    params = SamplingParams(
        temperature=1.5, max_tokens=12, ignore_eos=True, seed=5, n=2, allowed_token_ids=allowed
    )
    outs = llm.generate([PROMPTS[3]], params)
    assert [o.index for o in outs] == [0, 1]
    for sample in outs:
        assert set(sample.token_ids) <= set(allowed) and len(sample.token_ids) == 12
    assert len({tuple(s.token_ids) for s in outs}) == 2  # seeds 5 and 6
    again = llm.generate([PROMPTS[3]], params)
    assert [s.token_ids for s in again] == [s.token_ids for s in outs]


def test_logit_bias_and_min_tokens_compose_with_the_mask(llm):
    eos = min(llm.eos_token_ids)
    lifted = greedy(allowed_token_ids=[10, 11, 12], logit_bias={12: 100.0, 13: 100.0})
    assert llm.generate([PROMPTS[0]], lifted)[0].token_ids == [12] * 10
    # EOS, allowed and pushed to the top, ends the output once min_tokens lets it.
    held = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        min_tokens=4,
        allowed_token_ids=[eos, 30, 31],
        logit_bias={eos: 50.0},
    )
    [out] = llm.generate([PROMPTS[1]], held)
    assert out.token_ids == hf_allowed_tokens(PROMPTS[1], held, llm.eos_token_ids)
    assert out.token_ids[-1] == eos and len(out.token_ids) == 5
    assert set(out.token_ids[:4]) <= {30, 31}


def test_a_mask_that_the_bans_empty_fails_nothing(llm):
    """min_tokens bans the only token allowed: no token is left (the user's problem, as in
    vLLM); the request still ends, and the engine serves the next one."""
    eos = min(llm.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3, allowed_token_ids=[eos])
    sampled = SamplingParams(
        temperature=1.0, top_p=0.9, seed=1, max_tokens=3, min_tokens=3, allowed_token_ids=[eos]
    )
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], [params, sampled])
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert all(0 <= t < VOCAB for o in outs for t in o.token_ids)
    assert llm.generate([PROMPTS[1]], greedy())[0].token_ids == hf_greedy(tuple(PROMPTS[1]), 10)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([5, VOCAB], rf"allowed_token_ids: token id {VOCAB} is outside the vocabulary \[0, 320\)"),
        ([], r"allowed_token_ids is empty: it would allow no token"),
        ([-2], r"allowed_token_ids: token id -2 is outside the vocabulary"),
    ],
)
def test_bad_ids_are_refused_before_anything_runs(llm: LLM, ids, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hi"], SamplingParams(allowed_token_ids=ids))
    assert llm.stats().num_running == 0 and llm.stats().num_waiting == 0
