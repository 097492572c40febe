"""vLLM's SamplingParams.detokenize and truncate_prompt_tokens through LLM on the tiny
model: detokenize=False gives the tokens of True with no text and no detokenizer made;
truncate_prompt_tokens generates as the prompt's last k tokens would, for text and token
ids (-1: up to max_model_len); bad values are refused as the params are made, or before
anything is sent; the CLI counts a prompt as it will be cut; an engine core refuses a
prompt its client did not cut."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from messages import SamplingParams
from messages.examples_engine_core import engine_core_config, rollout_request
from tests.test_engine_e2e import PROMPTS, make_llm
from zmqworker.cli.preflight import check_run
from zmqworker.cli.prompts import PromptItem
from zmqworker.engine.request_message import request_of
from zmqworker.frontend import new_requests
from zmqworker.frontend.llm import LLM

MAX_MODEL_LEN = 96  # make_llm's
TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def llm():
    with make_llm() as engine:
        yield engine


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **kw})


def test_the_fields_are_checked_as_the_params_are_made():
    with pytest.raises(ValueError, match="^stop strings are only supported when detokenize"):
        SamplingParams(stop=["\n"], detokenize=False)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    # The wire refuses them too: decoding runs the same checks.
    wire = msgspec.msgpack.encode({"type": "SamplingParams", "stop": ["x"], "detokenize": False})
    with pytest.raises(ValueError, match="detokenize"):
        msgspec.msgpack.decode(wire, type=SamplingParams)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm: LLM, monkeypatch):
    prompts = [TEXT, PROMPTS[0]]
    texts = llm.generate(prompts, greedy(logprobs=2, prompt_logprobs=1))

    def no_detokenizer(*args, **kwargs):
        raise AssertionError("a detokenizer was made for a detokenize=False request")

    monkeypatch.setattr(new_requests, "IncrementalDetokenizer", no_detokenizer)
    params = greedy(logprobs=2, prompt_logprobs=1, detokenize=False)
    ids = llm.generate(prompts, params)
    for with_text, only_ids in zip(texts, ids, strict=True):
        assert with_text.text and only_ids.text == ""
        assert only_ids.token_ids == with_text.token_ids
        assert [p.sampled.logprob for p in only_ids.logprobs] == pytest.approx(
            [p.sampled.logprob for p in with_text.logprobs]
        )
        # vLLM's: no decoded token in logprobs either.
        assert all(e.text is None for p in only_ids.logprobs for e in [p.sampled, *p.top])
        assert all(p is None or p.sampled.text is None for p in only_ids.prompt_logprobs)
    assert ids[0].prompt == TEXT  # the prompt as given, its text untouched

    async def stream() -> list:
        return [out async for out in llm.generate_stream(TEXT, greedy(detokenize=False))]

    outs = asyncio.run(stream())
    assert all(out.new_text == "" and out.text == "" for out in outs)
    assert outs[-1].token_ids == texts[0].token_ids


def test_truncate_prompt_tokens_generates_from_the_prompt_s_last_tokens(llm: LLM):
    tokens = llm.encode(TEXT)
    [cut_text, cut_ids, whole] = llm.generate(
        [TEXT, PROMPTS[2], tokens[-5:]],
        [greedy(truncate_prompt_tokens=5), greedy(truncate_prompt_tokens=7), greedy()],
    )
    assert cut_text.prompt_token_ids == tokens[-5:] and cut_text.prompt == TEXT
    assert cut_text.token_ids == whole.token_ids
    [from_last] = llm.generate([PROMPTS[2][-7:]], greedy())
    assert cut_ids.prompt_token_ids == PROMPTS[2][-7:]
    assert cut_ids.token_ids == from_last.token_ids
    # Longer than the prompt: the whole prompt.
    [kept] = llm.generate([PROMPTS[1]], greedy(truncate_prompt_tokens=50))
    assert kept.prompt_token_ids == PROMPTS[1]


def test_minus_one_keeps_up_to_max_model_len_and_bad_values_are_refused(llm: LLM):
    long = [i % 300 + 3 for i in range(150)]
    with pytest.raises(ValueError, match="more than max_model_len=96"):
        llm.generate([long], greedy(max_tokens=1))
    [out] = llm.generate([long], greedy(max_tokens=1, truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == long[-MAX_MODEL_LEN:]
    [cut] = llm.generate([long], greedy(truncate_prompt_tokens=50))
    assert cut.prompt_token_ids == long[-50:] and len(cut.token_ids) == 8
    with pytest.raises(ValueError, match="^prompt 1: truncate_prompt_tokens must be -1 or from 1"):
        llm.generate([TEXT, TEXT], [greedy(), greedy(truncate_prompt_tokens=MAX_MODEL_LEN + 1)])
    [after] = llm.generate([TEXT], greedy())  # nothing was sent: the engine goes on
    assert len(after.token_ids) == 8


def test_the_cli_counts_a_prompt_as_it_will_be_cut():
    from tests.test_engine_e2e import checkpoint_with_tokenizer

    run = dict(
        model=checkpoint_with_tokenizer(), max_model_len=MAX_MODEL_LEN, max_logprobs=20,
        chat=False, system=None,
    )  # fmt: skip
    long = PromptItem(prompt=list(range(3, 203)))
    with pytest.raises(ValueError, match="more than max_model_len=96"):
        check_run([long], {}, **run)
    [job] = check_run([long], {"truncate_prompt_tokens": 10}, **run)
    assert job.num_tokens == 10
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or from 1"):
        check_run([long], {"truncate_prompt_tokens": 97}, **run)


def test_an_engine_core_refuses_a_prompt_its_client_did_not_cut():
    request = rollout_request()  # its 24 tokens, cut to truncate_prompt_tokens=24
    assert len(request_of(request, engine_core_config()).prompt_token_ids) == 24
    params = msgspec.structs.replace(request.sampling_params, truncate_prompt_tokens=20)
    uncut = msgspec.structs.replace(request, sampling_params=params)
    with pytest.raises(ValueError, match="24 tokens, more than truncate_prompt_tokens=20"):
        request_of(uncut, engine_core_config())
