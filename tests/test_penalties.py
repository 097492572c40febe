"""The penalties and biases on logits, piece by piece: the torch ops equal transformers'
RepetitionPenaltyLogitsProcessor and vLLM's frequency and presence formula written out,
the Triton kernels (through the interpreter) equal the torch ops, and the per-row state
(penalty_rows.py) resets, counts, and bans what min_tokens and the bad words say. On the
CPU the kernels run in the interpreter; with ZMQWORKER_TEST_DEVICE=cuda, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from messages import SamplingParams
from tests.runner_helpers import DEVICE
from zmqworker.model_runner.penalties import apply_penalties, count_outputs
from zmqworker.model_runner.penalty_rows import PenaltyRows

VOCAB = 300  # not a multiple of 32: the last word of the prompt bits is partial


def fused_params() -> list[bool]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return [False]
    return [False, True]


def random_logits(n: int, seed: int, scale: float) -> torch.Tensor:
    return (torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def random_tokens(rng: np.random.Generator, n: int, high: int = 40) -> np.ndarray:
    """Tokens from a small range, so that they repeat."""
    return rng.integers(0, high, n).astype(np.int32)


def reference(
    logits: torch.Tensor, prompt: np.ndarray, output: np.ndarray, params: SamplingParams
) -> torch.Tensor:
    """One row as transformers and vLLM's formula take it: bias, then the repetition
    penalty over prompt and output, then frequency and presence over the output."""
    scores = logits.clone().unsqueeze(0)
    for token, bias in params.logit_bias.items():
        scores[0, token] += bias
    if params.repetition_penalty != 1.0:
        ids = torch.from_numpy(np.concatenate([prompt, output]).astype(np.int64)).unsqueeze(0)
        processor = transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        scores = processor(ids, scores)
    counts = torch.bincount(torch.from_numpy(output.astype(np.int64)), minlength=VOCAB)
    scores = scores - params.frequency_penalty * counts
    scores = scores - params.presence_penalty * (counts > 0)
    return scores[0]


PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(),  # none: its row is left as it is
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0),
    SamplingParams(logit_bias={3: 100.0, 299: -7.5}),
    SamplingParams(repetition_penalty=1.1, logit_bias={5: 2.0}, presence_penalty=0.5),
]


@pytest.mark.parametrize("fused", fused_params())
def test_penalties_change_the_logits_as_transformers_and_the_formula_say(fused):
    rng = np.random.default_rng(0)
    state = PenaltyRows(8, VOCAB, DEVICE)
    rows = np.array([5, 0, 7, 2, 3, 1], np.int64)  # batch rows, in sample order
    prompts = [random_tokens(rng, 12) for _ in rows]
    outputs = [random_tokens(rng, int(k)) for k in rng.integers(0, 20, len(rows))]
    num_tokens = np.zeros(8, np.int64)
    num_prompt = np.zeros(8, np.int64)
    for row, params, prompt, output in zip(rows, PARAMS, prompts, outputs, strict=True):
        tokens = np.concatenate([prompt, output])
        state.add(int(row), params, tokens, len(prompt), [])
        num_tokens[row], num_prompt[row] = len(tokens), len(prompt)
    state.flush()
    table = np.zeros((8, 64), np.int32)
    logits = random_logits(len(rows), 1, 4.0)
    logits[:, :8] = 0.0  # the repetition penalty leaves a zero logit at zero
    step = state.step(rows, num_tokens, num_prompt, table)
    assert step is not None
    got = logits.clone()
    apply_penalties(got, step, fused)
    for i, (params, prompt, output) in enumerate(zip(PARAMS, prompts, outputs, strict=True)):
        want = reference(logits[i].cpu(), prompt, output, params)
        torch.testing.assert_close(got[i].cpu(), want, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])


@pytest.mark.parametrize("sampling", [[5, 0, 7, 2, 3, 1], [7]])  # [7]: no prompt bits
def test_the_triton_kernels_give_the_torch_ops_bits(sampling):
    pytest.importorskip("triton")
    rng = np.random.default_rng(2)
    state = PenaltyRows(8, VOCAB, DEVICE)
    for row, params in zip([5, 0, 7, 2, 3, 1], PARAMS, strict=True):
        state.add(row, params, random_tokens(rng, 30), 11, [])
    state.flush()
    rows = np.array(sampling, np.int64)
    step = state.step(rows, np.full(8, 30), np.full(8, 11), np.zeros((8, 64), np.int32))
    assert step is not None and step.dense is not None
    assert step.dense.repetition == (len(sampling) > 1)
    logits = random_logits(len(rows), 3, 5.0)
    by_torch, by_triton = logits.clone(), logits.clone()
    apply_penalties(by_torch, step, fused=False)
    apply_penalties(by_triton, step, fused=True)
    if DEVICE.type == "cpu":  # the interpreter computes as numpy, in the torch ops' order
        assert torch.equal(by_torch, by_triton)
    else:  # a GPU may fuse a multiply and a subtraction
        torch.testing.assert_close(by_torch, by_triton, rtol=1e-6, atol=1e-6)
    sampled = torch.from_numpy(rng.integers(0, VOCAB, len(rows)).astype(np.int32)).to(DEVICE)
    counts = state.counts.clone()
    count_outputs(step, sampled, fused=False)
    by_torch_counts = state.counts.clone()
    state.counts.copy_(counts)
    count_outputs(step, sampled, fused=True)
    assert torch.equal(state.counts, by_torch_counts)
    assert not torch.equal(counts, by_torch_counts)


def test_a_row_counts_its_outputs_and_starts_over_when_reused():
    state = PenaltyRows(4, VOCAB, DEVICE)
    params = SamplingParams(frequency_penalty=1.0)
    state.add(2, params, np.array([9, 9, 4, 4, 4, 7], np.int32), 3, [])
    state.flush()
    counts = state.counts[2]
    assert counts[4].item() == 2 and counts[7].item() == 1 and counts[9].item() == 0
    step = state.step(np.array([2]), np.full(4, 6), np.full(4, 3), np.zeros((4, 8), np.int32))
    assert step is not None
    count_outputs(step, torch.tensor([7], dtype=torch.int32, device=DEVICE), fused=False)
    assert state.counts[2, 7].item() == 2
    state.remove(2)
    assert state.step(np.array([2]), np.full(4, 6), np.full(4, 3), np.zeros((4, 8))) is None
    state.add(2, params, np.array([1, 2], np.int32), 2, [])
    state.flush()
    assert state.counts[2].sum().item() == 0  # nothing of the row's last request


def test_repetition_reads_the_prompt_bits():
    state = PenaltyRows(2, VOCAB, DEVICE)
    prompt = np.array([0, 31, 32, 63, 64, 299], np.int32)  # word edges and the last token
    state.add(1, SamplingParams(repetition_penalty=2.0), prompt, len(prompt), [])
    state.flush()
    step = state.step(np.array([1]), np.full(2, 6), np.full(2, 6), np.zeros((2, 8), np.int32))
    logits = torch.ones(1, VOCAB, device=DEVICE)
    apply_penalties(logits, step, fused=False)
    assert torch.nonzero(logits[0] != 1.0).flatten().tolist() == prompt.tolist()


def test_steps_of_requests_without_any_cost_nothing():
    state = PenaltyRows(4, VOCAB, DEVICE)
    state.add(0, SamplingParams(temperature=0.5, top_k=3), np.arange(5, dtype=np.int32), 5, [])
    state.flush()
    assert state.step(np.array([0]), np.full(4, 5), np.full(4, 5), np.zeros((4, 8))) is None
    state.add(1, SamplingParams(presence_penalty=1.0), np.arange(5, dtype=np.int32), 5, [])
    # Row 1 uses a penalty, but only row 0 samples.
    assert state.step(np.array([0]), np.full(4, 5), np.full(4, 5), np.zeros((4, 8))) is None


def test_a_step_like_the_one_before_uses_its_upload_again():
    """The same sampling rows with no row joined or left, and no bans: the step before's
    device tensors as they are; anything else uploads anew."""
    state = PenaltyRows(4, VOCAB, DEVICE)
    params = SamplingParams(frequency_penalty=0.5, logit_bias={3: 1.0})
    state.add(1, params, np.arange(5, dtype=np.int32), 5, [])
    state.flush()
    columns = (np.full(4, 5), np.full(4, 5), np.zeros((4, 8), np.int32))
    first = state.step(np.array([0, 1]), *columns)
    assert first is not None and state.step(np.array([0, 1]), *columns) is first
    assert state.step(np.array([1, 0]), *columns) is not first  # other logits rows
    state.add(2, SamplingParams(presence_penalty=1.0), np.arange(5, dtype=np.int32), 5, [])
    state.flush()
    joined = state.step(np.array([0, 1]), *columns)
    assert joined is not None and joined is not first
    assert torch.equal(joined.dense.penalties, first.dense.penalties)
    held = SamplingParams(min_tokens=2, stop_token_ids=[17])
    state.add(3, held, np.arange(5, dtype=np.int32), 5, [])
    banning = state.step(np.array([3]), *columns)  # no output yet: 17 is banned
    assert banning is not None and banning.bans is not None
    again = state.step(np.array([3]), *columns)
    assert again is not banning and again.bans is not None  # bans are found every step
    free = (np.full(4, 7), np.full(4, 5), np.zeros((4, 8), np.int32))  # 2 outputs now
    assert state.step(np.array([3]), *free) is None


def bans(state: PenaltyRows, rows, num_tokens, num_prompt, table) -> set[tuple[int, int]]:
    """(logits row, token) pairs the step bans."""
    step = state.step(np.array(rows), np.array(num_tokens), np.array(num_prompt), table)
    if step is None or step.bans is None:
        return set()
    index = step.index_of_row
    pairs = zip(step.bans.rows.tolist(), step.bans.tokens.tolist(), strict=True)
    return {(int(index[r]), t) for r, t in pairs}


def test_min_tokens_holds_eos_and_the_stop_ids_back_until_the_output_is_long_enough():
    state = PenaltyRows(3, VOCAB, DEVICE)
    params = SamplingParams(min_tokens=3, stop_token_ids=[17, 5000], max_tokens=8)
    state.add(0, params, np.arange(4, dtype=np.int32), 4, eos_token_ids=[2, 9999])
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True, max_tokens=8)
    state.add(1, ignoring, np.arange(4, dtype=np.int32), 4, eos_token_ids=[2])
    table = np.zeros((3, 16), np.int32)
    # Ids outside the vocabulary (5000, 9999) are never sampled: nothing to hold back.
    # Row 1 ignores EOS, which min_tokens holds back all the same (as vLLM does).
    assert bans(state, [1, 0], [4, 4, 0], [4, 4, 0], table) == {(0, 2), (1, 2), (1, 17)}
    assert bans(state, [0], [6, 0, 0], [4, 0, 0], table) == {(0, 2), (0, 17)}
    assert bans(state, [0], [7, 0, 0], [4, 0, 0], table) == set()  # 3 outputs: free


def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest():
    state = PenaltyRows(2, VOCAB, DEVICE)
    words = [[7], [10, 11], [20, 21, 22]]
    state.add(1, SamplingParams(bad_words_token_ids=words), np.array([10], np.int32), 1, [])
    table = np.zeros((2, 16), np.int32)
    # Just the prompt: only the one-token word (its prefix would be the prompt's token 10).
    assert bans(state, [1], [0, 1], [0, 1], table) == {(0, 7)}
    table[1, :4] = [10, 10, 20, 21]
    assert bans(state, [1], [0, 4], [0, 1], table) == {(0, 7), (0, 22)}
    assert bans(state, [1], [0, 2], [0, 1], table) == {(0, 7), (0, 11)}
    assert bans(state, [1], [0, 3], [0, 1], table) == {(0, 7)}


def test_a_dummy_step_writes_nothing_of_the_batch():
    state = PenaltyRows(4, VOCAB, DEVICE)
    state.add(0, SamplingParams(frequency_penalty=1.0), np.array([1, 5, 5], np.int32), 1, [])
    state.flush()
    before = state.counts.clone(), state.prompt_bits.clone()
    logits = torch.randn(4, VOCAB, device=DEVICE)
    apply_penalties(logits, state.dummy_step(4), fused=False)
    assert torch.equal(state.counts, before[0]) and torch.equal(state.prompt_bits, before[1])
    assert torch.isinf(logits[:, 0]).all()


def test_a_preempted_request_counts_its_outputs_again_when_it_comes_back():
    """Resumed with its KV kept, or re-added as new with its outputs in its prompt
    (num_output_tokens): either way its tokens are those of a run without preemption."""
    from tests.runner_helpers import MiniScheduler, Pipeline, checkpoint, make_runner

    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, min_tokens=12
    )
    prompts = {"a": [5, 9, 14, 3, 77, 41, 8, 9, 9], "b": [60, 2, 33, 90, 11, 60]}
    results = []
    for preempt in (False, True):
        pipeline = Pipeline([make_runner(checkpoint("llama"), max_seqs=2)])
        sched = MiniScheduler(budget=16, seed=4)
        reqs = {name: sched.add(name, prompt, 14, params) for name, prompt in prompts.items()}
        for step in range(40):
            if preempt and step == 5:
                sched.preempt(reqs["a"], "resume")
            if preempt and step == 8:
                sched.preempt(reqs["b"], "readd")
            if not sched.busy():
                break
            sched.update(pipeline.step(sched.schedule()))
        results.append({name: req.outputs for name, req in reqs.items()})
    assert results[0] == results[1] and all(len(out) == 14 for out in results[0].values())
