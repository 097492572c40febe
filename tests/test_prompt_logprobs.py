"""prompt_logprobs (vLLM's): per prompt position after the first, the prompt token's
logprob and rank and the top k, equal to transformers' log_softmax of the same tiny
model; over a prefill chunked across steps, with prefix caching on (such a request takes
no hits: every position is computed), next to requests that ask none."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import transformers

from messages import LogprobsLists, SamplingParams
from tests.test_engine_e2e import checkpoint_with_tokenizer, make_llm
from zmqworker.engine.prompt_logprobs import PromptLogprobRows
from zmqworker.frontend.llm import LLM
from zmqworker.model_runner import prompt_logprobs as prompt_module

PROMPT = [(7 * i + 3) % 300 for i in range(50)]  # 50 tokens: three prefill steps of 24


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with make_llm(enable_prefix_caching=True) as engine:
        yield engine


@functools.cache
def reference(prompt: tuple[int, ...]) -> torch.Tensor:
    """transformers' log_softmax at each position: row j predicts token j + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint_with_tokenizer(), dtype=torch.float32
    )
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0], dim=-1)


def check_against_reference(prompt: list[int], entries: list, k: int) -> None:
    expected = reference(tuple(prompt))
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], expected[p - 1]
        assert entry.sampled.token_id == prompt[p]
        np.testing.assert_allclose(entry.sampled.logprob, row[prompt[p]].item(), atol=1e-4)
        assert entry.rank == int((row > row[prompt[p]]).sum()) + 1
        top = row.topk(k)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        np.testing.assert_allclose([t.logprob for t in entry.top], top.values.numpy(), atol=1e-4)


def test_prompt_logprobs_equal_transformers_over_a_chunked_prefill(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([PROMPT], plain)  # the prefix cache now holds the prompt's blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    before = llm.stats().num_prefill_tokens
    outs = llm.generate([PROMPT, [1, 2, 3], [9]], params)
    # No prefix-cache hit: all 50 + 3 + 1 prompt tokens are computed.
    assert llm.stats().num_prefill_tokens - before == len(PROMPT) + 4
    check_against_reference(PROMPT, outs[0].prompt_logprobs, 3)
    check_against_reference([1, 2, 3], outs[1].prompt_logprobs, 3)
    assert outs[2].prompt_logprobs == [None]
    assert outs[0].token_ids == llm.generate([PROMPT], plain)[0].token_ids
    assert outs[0].prompt_logprobs[1].sampled.text == llm.tokenizer.decode([PROMPT[1]])


def test_prompt_logprobs_zero_is_the_prompt_token_alone_and_bounds_are_named(llm):
    out = llm.generate([PROMPT[:6]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    assert out.logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs=21 is more than max_logprobs=20"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 \(the whole vocabulary"):
        SamplingParams(prompt_logprobs=-1)


def test_rows_are_made_a_chunk_of_rows_at_a_time(monkeypatch):
    """The logits of a long prompt never exist whole: a chunk of rows at a time, each
    row the same as from the whole block."""
    vocab, hidden_size, rows = 50, 8, 10
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    seen: list[int] = []

    class Model:
        vocab_size = vocab

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            seen.append(len(hidden))
            return head(hidden).float()

    monkeypatch.setattr(prompt_module, "CHUNK_BYTES", 3 * 4 * vocab)
    hidden = torch.randn(rows, hidden_size)
    targets = np.arange(rows, dtype=np.int64) * 3
    plan = prompt_module.PromptPlan(
        np.arange(rows), targets, np.array([0], np.int32), np.array([1], np.int32),
        np.array([rows], np.int32), 4,
    )  # fmt: skip
    out = prompt_module.prompt_logprobs(Model(), hidden, plan)
    assert seen == [3, 3, 3, 1]
    expected = torch.log_softmax(head(hidden).detach(), -1)
    chosen = expected[torch.arange(rows), torch.from_numpy(targets)]
    np.testing.assert_allclose(out.rows.logprobs[:, 0], chosen.numpy(), atol=1e-5)
    np.testing.assert_allclose(out.rows.logprobs[:, 1:], expected.topk(4).values, atol=1e-5)
    ranks = (expected > chosen.unsqueeze(1)).sum(-1) + 1
    assert out.rows.sampled_token_ranks.tolist() == ranks.tolist()


def test_the_engine_core_drops_rows_it_holds_and_refuses_a_gap():
    """A prefill computed again (after a preemption) sends rows from position 1 again."""

    def rows(first: int, count: int) -> LogprobsLists:
        ids = np.arange(first, first + count, dtype=np.int32)[:, None].repeat(3, axis=1)
        return LogprobsLists(ids, ids.astype(np.float32), ids[:, 0].copy())

    held = PromptLogprobRows("r", num_top=1)
    held.add(1, rows(1, 4), 0, 4)
    held.add(1, rows(1, 6), 0, 6)  # positions 1..4 again, then 5 and 6
    with pytest.raises(RuntimeError, match="from position 9, it holds positions 1..6"):
        held.add(9, rows(9, 2), 0, 2)
    out = held.take()
    assert out.logprob_token_ids.shape == (6, 2)  # k + 1 columns of the 3 sent
    assert out.sampled_token_ranks.tolist() == [1, 2, 3, 4, 5, 6]
