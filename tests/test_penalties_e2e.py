"""Penalties, logit_bias, min_tokens and bad words through the reference engine and real
worker processes on a tiny model, async scheduling on (the device-side counts of one step
read by the next while it is already queued): greedy tokens equal transformers'
generate with the same logits processors (vLLM's frequency and presence formula written
out as one), in a batch that mixes requests with and without them, and through
preemption, where a request restarts with its outputs counted again."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import msgspec
import pytest
import torch
import transformers

from messages import SamplingParams
from tests.test_engine_e2e import PROMPTS, checkpoint_with_tokenizer, hf_greedy, make_llm
from zmqworker.frontend.llm import LLM


class OpenAIPenalties(transformers.LogitsProcessor):
    """vLLM's (OpenAI's) frequency and presence penalties over the generated tokens:
    logit - frequency * count, then - presence * (count > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, output, torch.ones_like(output, dtype=scores.dtype)
        )
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0)


def processors(prompt: list[int], params: SamplingParams, eos: frozenset[int]) -> list:
    """transformers' processors doing what params asks, in vLLM's order."""
    found: list = []
    if params.min_tokens:
        found.append(
            transformers.MinNewTokensLengthLogitsProcessor(
                len(prompt), params.min_tokens, sorted(eos)
            )
        )
    if params.bad_words_token_ids:
        found.append(
            transformers.NoBadWordsLogitsProcessor(params.bad_words_token_ids, eos_token_id=None)
        )
    if params.logit_bias:
        bias = {(token,): value for token, value in params.logit_bias.items()}
        found.append(transformers.SequenceBiasLogitsProcessor(bias))
    if params.repetition_penalty != 1.0:
        found.append(transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        found.append(
            OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)
        )
    return found


@functools.cache
def hf_model() -> transformers.PreTrainedModel:
    path = checkpoint_with_tokenizer()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_tokens(
    prompt: list[int],
    params: SamplingParams,
    eos: frozenset[int],
    first: Sequence[transformers.LogitsProcessor] = (),
) -> list[int]:
    """transformers' greedy tokens: up to max_tokens, or up to EOS (kept) unless ignore_eos;
    first: processors ahead of params' own."""
    found = [*first, *processors(prompt, params, eos)]
    ids = torch.tensor([prompt])
    out = hf_model().generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=params.max_tokens,
        do_sample=False,
        eos_token_id=None if params.ignore_eos else sorted(eos),
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList(found),
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llm():
    # One pipeline stage: the engine core schedules asynchronously (LLM's default), so
    # each step's penalties read counts the step before it has yet to finish writing.
    with make_llm() as engine:
        yield engine


MIXED = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
    ),
    SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.2,
        frequency_penalty=0.8,
        presence_penalty=-0.3,
        logit_bias={40: 4.0, 100: -2.0},
    ),
]


def test_penalised_greedy_tokens_are_transformers_in_a_mixed_batch(llm):
    outs = llm.generate(PROMPTS, MIXED)
    for prompt, params, out in zip(PROMPTS, MIXED, outs, strict=True):
        assert out.token_ids == hf_tokens(prompt, params, llm.eos_token_ids), params
    # Not vacuous: the penalties change what plain greedy decoding gives.
    for prompt, out in zip(PROMPTS[1:3], outs[1:3], strict=True):
        assert out.token_ids != hf_greedy(tuple(prompt), 16)


def test_logit_bias_forces_a_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    [out] = llm.generate([PROMPTS[0]], params)
    assert out.token_ids == [77] * 6


def test_min_tokens_holds_eos_back(llm):
    """EOS pushed to the top: the first min_tokens tokens are the best of the others, then
    EOS ends the output (kept, as transformers keeps it)."""
    eos = min(llm.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, logit_bias={eos: 50.0})
    outs = llm.generate(PROMPTS[:2], [params, SamplingParams(temperature=0.0, max_tokens=12)])
    assert outs[0].token_ids == hf_tokens(PROMPTS[0], params, llm.eos_token_ids)
    assert len(outs[0].token_ids) == 6 and outs[0].token_ids[-1] == eos
    assert outs[0].finish_reason == "stop"
    assert not set(outs[0].token_ids[:5]) & llm.eos_token_ids
    # With ignore_eos too (as vLLM's): held back, then sampled without ending the output.
    ignoring = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=5, ignore_eos=True, logit_bias={eos: 50.0}
    )
    [out] = llm.generate([PROMPTS[0]], ignoring)
    assert out.token_ids[:6] == outs[0].token_ids and out.token_ids[6:] == [eos, eos]
    assert out.finish_reason == "length"


def test_bad_words_are_not_generated(llm):
    prompt = PROMPTS[0]
    free = hf_greedy(tuple(prompt), 12)
    first, second = free[4], free[5]
    assert prompt[-1] != first  # transformers would also look at the prompt's last token
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        bad_words_token_ids=[[first, second], [free[0] + 1]],
    )
    [out] = llm.generate([prompt], params)
    assert out.token_ids == hf_tokens(prompt, params, llm.eos_token_ids)
    assert out.token_ids[:5] == free[:5] and out.token_ids[5] != second


def test_bad_words_as_text_are_tokenized_by_the_engine(llm):
    """A word is banned as it would start the text and as it would follow a space (here
    two different tokens), as vLLM bans it."""
    prompt = llm.encode("Hello world")
    free = hf_greedy(tuple(prompt), 12)
    alone = llm.tokenizer.encode("he", add_special_tokens=False)
    spaced = llm.tokenizer.encode(" he", add_special_tokens=False)
    assert len(alone) == len(spaced) == 1 and alone != spaced and alone[0] in free
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=["he"])
    [out] = llm.generate([prompt], params)
    as_ids = msgspec.structs.replace(params, bad_words=[], bad_words_token_ids=[alone, spaced])
    assert out.token_ids == hf_tokens(prompt, as_ids, llm.eos_token_ids)
    assert not {alone[0], spaced[0]} & set(out.token_ids)


def test_penalties_survive_preemption():
    """A KV cache too small for the batch: requests are preempted and restart with their
    outputs as part of their prompt; the workers count those as outputs again."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    )
    with make_llm(kv_cache_bytes=25 * 4096) as engine:
        outs = engine.generate(PROMPTS, params)
        assert engine.stats().num_preemptions > 0
        eos = engine.eos_token_ids
    assert [o.token_ids for o in outs] == [hf_tokens(p, params, eos) for p in PROMPTS]


def test_bad_values_are_refused_before_anything_runs(llm: LLM):
    with pytest.raises(ValueError, match=r"logit_bias: token id 320 is outside the vocabulary"):
        llm.generate(["Hi"], SamplingParams(logit_bias={320: 1.0}))
    with pytest.raises(ValueError, match=r"bad_words\[0\] is only whitespace"):
        llm.generate(["Hi"], SamplingParams(bad_words=["  "]))
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must be at most max_tokens \(8\)"):
        SamplingParams(min_tokens=9, max_tokens=8)
    assert llm.stats().num_running == 0 and llm.stats().num_waiting == 0


def test_penalties_on_the_last_of_two_pipeline_stages():
    """Only the last stage samples, so only it keeps the counts; the first gets the
    sampled tokens in the step's deltas and keeps none."""
    with make_llm(pp=2) as engine:
        outs = engine.generate(PROMPTS, MIXED)
        eos = engine.eos_token_ids
    for prompt, params, out in zip(PROMPTS, MIXED, outs, strict=True):
        assert out.token_ids == hf_tokens(prompt, params, eos), params
