"""The sampler on hand-made logits: greedy, filters, seeds, logprobs and grammar bitmasks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zmqworker.cdiv import cdiv
from zmqworker.model_runner.grammar import apply_grammar_bitmask
from zmqworker.model_runner.input_batch import draw_seeds
from zmqworker.model_runner.sampler import Sampler, SamplingMetadata

VOCAB = 64
CPU = torch.device("cpu")


def metadata(
    n: int,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    logprobs: int | list[int] = -1,
    seeds: dict[int, int] | None = None,
) -> SamplingMetadata:
    def column(value, dtype):
        return np.broadcast_to(np.asarray(value, dtype), (n,)).copy()

    return SamplingMetadata.build(
        column(temperature, np.float32),
        column(top_k, np.int32),
        column(top_p, np.float32),
        column(min_p, np.float32),
        column(logprobs, np.int32),
        seeds or {},
        VOCAB,
        CPU,
    )


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    return base.repeat(n, 1)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> np.ndarray:
    torch.manual_seed(1234)
    return Sampler()(logits.clone(), meta).sampled_token_ids.numpy()


def test_greedy_is_argmax_and_takes_the_fast_path() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    meta = metadata(5, temperature=0.0)
    assert meta.all_greedy and meta.temperature is None
    out = Sampler()(logits.clone(), meta)
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.logprobs is None
    np.testing.assert_array_equal(out.sampled_token_ids.numpy(), logits.argmax(-1).numpy())


def test_greedy_rows_stay_greedy_in_a_random_batch() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4))
    temps = [0.0, 1.5, 0.0, 2.0, 0.0, 1.0]
    tokens = sample(logits, metadata(6, temperature=temps, top_k=[0, 5, 3, 0, 2, 0]))
    greedy = logits.argmax(-1).numpy()
    np.testing.assert_array_equal(tokens[[0, 2, 4]], greedy[[0, 2, 4]])


def test_random_sampling_follows_softmax() -> None:
    n = 20000
    logits = logits_rows(n, seed=5)[:, :8].contiguous()
    meta = SamplingMetadata.build(
        np.ones(n, np.float32),
        np.zeros(n, np.int32),
        np.ones(n, np.float32),
        np.zeros(n, np.float32),
        np.full(n, -1, np.int32),
        {},
        8,
        CPU,
    )
    torch.manual_seed(0)
    tokens = Sampler()(logits.clone(), meta).sampled_token_ids.numpy()
    freq = np.bincount(tokens, minlength=8) / n
    np.testing.assert_allclose(freq, logits[0].softmax(-1).numpy(), atol=0.02)


def test_temperature_sharpens_the_distribution() -> None:
    n = 4000
    logits = logits_rows(n, seed=6)
    hot = sample(logits, metadata(n, temperature=2.0))
    cold = sample(logits, metadata(n, temperature=0.1))
    top = int(logits[0].argmax())
    assert (cold == top).mean() > 0.95
    assert (hot == top).mean() < 0.5
    assert len(set(hot.tolist())) > 10


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_samples_outside_the_top_k(k: int) -> None:
    n = 3000
    logits = logits_rows(n, seed=7)
    tokens = sample(logits, metadata(n, temperature=3.0, top_k=k))
    allowed = set(logits[0].topk(k).indices.tolist())
    assert set(tokens.tolist()) == allowed  # every allowed token shows up at this temperature


def test_top_k_per_row_with_rows_that_disable_it() -> None:
    n = 3000
    logits = logits_rows(n, seed=8)
    ks = np.where(np.arange(n) % 2 == 0, 2, 0)
    tokens = sample(logits, metadata(n, temperature=3.0, top_k=ks.tolist()))
    top2 = set(logits[0].topk(2).indices.tolist())
    assert set(tokens[0::2].tolist()) <= top2
    assert len(set(tokens[1::2].tolist())) > 2


def top_p_set(row: torch.Tensor, p: float) -> set[int]:
    probs, order = row.softmax(-1).sort(descending=True)
    keep = int((probs.cumsum(-1) < p).sum()) + 1
    return set(order[:keep].tolist())


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float) -> None:
    n = 4000
    logits = logits_rows(n, seed=9)
    tokens = sample(logits, metadata(n, top_p=p))
    assert set(tokens.tolist()) == top_p_set(logits[0], p)


def test_top_k_and_top_p_together() -> None:
    n = 3000
    logits = logits_rows(n, seed=10)
    tokens = sample(logits, metadata(n, temperature=1.0, top_k=4, top_p=0.95))
    k_set = set(logits[0].topk(4).indices.tolist())
    kept = logits[0].clone()
    kept[[i for i in range(VOCAB) if i not in k_set]] = -torch.inf
    assert set(tokens.tolist()) <= k_set & top_p_set(kept, 0.95)


def test_min_p_drops_tokens_below_the_fraction_of_the_top() -> None:
    n = 3000
    logits = logits_rows(n, seed=11)
    tokens = sample(logits, metadata(n, temperature=1.0, min_p=0.2))
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert set(tokens.tolist()) == allowed


def test_min_p_cuts_before_top_p_as_vllm_s() -> None:
    """top_p then sees min_p's distribution: of [0.6, 0.3, 0.1] with min_p 0.2 and top_p
    0.65, only the first token is left (top_p first kept the second too)."""
    logits = torch.full((2000, VOCAB), -torch.inf)
    logits[:, :3] = torch.tensor([0.6, 0.3, 0.1]).log()
    tokens = sample(logits, metadata(2000, temperature=1.0, top_p=0.65, min_p=0.2))
    assert set(tokens.tolist()) == {0}


def test_seeded_rows_ignore_their_batch_companions() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(12))
    target = logits[2:3]

    def run(batch: torch.Tensor, row: int, steps: int = 8) -> list[int]:
        meta = metadata(len(batch), temperature=1.0, seeds={row: 99})
        tokens = []
        for _ in range(steps):
            tokens.append(int(Sampler()(batch.clone(), meta).sampled_token_ids[row]))
        return tokens

    alone = run(target, 0)
    crowded = run(logits, 2)
    assert alone == crowded
    assert len(set(alone)) > 1  # the generator advances from step to step
    other_seed = SamplingMetadata.build(
        np.ones(1, np.float32),
        np.zeros(1, np.int32),
        np.ones(1, np.float32),
        np.zeros(1, np.float32),
        np.full(1, -1, np.int32),
        {0: 7},
        VOCAB,
        CPU,
    )
    others = [int(Sampler()(target.clone(), other_seed).sampled_token_ids[0]) for _ in range(8)]
    assert others != alone


def test_only_rows_that_sample_at_random_get_a_generator(monkeypatch) -> None:
    """A generator costs microseconds to make: a greedy row's seed makes none, in an
    all-greedy batch (the argmax fast path) or a mixed one."""
    made = []
    real = torch.Generator

    def counting(*args, **kwargs) -> torch.Generator:
        made.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "Generator", counting)
    greedy = metadata(3, temperature=0.0, seeds={0: 5, 2: 6})
    assert greedy.all_greedy and not greedy.generators and not made
    mixed = metadata(3, temperature=[0.0, 1.0, 1.0], seeds={0: 5, 1: 6})
    assert set(mixed.generators) == {1} and made == [CPU]


def race(row: torch.Tensor, temperature: float, seed: int) -> int:
    """The exponential race by hand, with a generator seeded seed: what a seeded row of
    the sampler draws."""
    probs = (row / temperature).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((probs / noise).argmax())


def test_a_mixed_batch_samples_each_seeded_and_greedy_row_as_alone() -> None:
    """Rows: greedy with a seed, random with a seed, random without. Every step draws by
    the seed of (request seed, samples so far), as InputBatch.sample_seeds gives it."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(17))
    temperature = [0.0, 1.3, 1.0]
    crowded, alone = [], []
    for sampled in range(8):
        seed = int(draw_seeds(np.array([42]), np.array([sampled]))[0])
        seeds = {0: int(draw_seeds(np.array([3]), np.array([sampled]))[0]), 1: seed}
        out = sample(logits, metadata(3, temperature=temperature, seeds=seeds))
        crowded.append(out[:2].tolist())
        assert 0 <= out[2] < VOCAB
        greedy_alone = sample(logits[0:1], metadata(1, temperature=0.0, seeds={0: seeds[0]}))
        random_alone = sample(logits[1:2], metadata(1, temperature=1.3, seeds={0: seed}))
        alone.append([int(greedy_alone[0]), int(random_alone[0])])
        assert out[1] == race(logits[1], 1.3, seed)  # the seed's draw, bit for bit
    assert crowded == alone
    assert {tokens[0] for tokens in crowded} == {int(logits[0].argmax())}
    assert len({tokens[1] for tokens in crowded}) > 1  # each sample draws anew


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(13))
    meta = metadata(4, temperature=[0.0, 0.7, 1.0, 0.0], top_k=5, logprobs=[3, -1, 2, 0])
    out = Sampler()(logits.clone(), meta)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_token_ranks is not None
    assert out.logprob_token_ids.shape == (4, 4) and out.logprob_token_ids.dtype == torch.int32
    assert out.logprobs.shape == (4, 4) and out.logprobs.dtype == torch.float32
    reference = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids.long()
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0].numpy(), sampled.numpy())
    torch.testing.assert_close(out.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top_values, top_ids = reference.topk(3, dim=-1)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:].numpy(), top_ids.numpy())
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    ranks = (reference > reference.gather(1, sampled[:, None])).sum(-1) + 1
    np.testing.assert_array_equal(out.sampled_token_ranks.numpy(), ranks.numpy())
    assert out.sampled_token_ranks[0] == 1 and out.sampled_token_ranks[3] == 1  # greedy rows


def test_zero_logprobs_gives_only_the_sampled_column() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(14))
    out = Sampler()(logits.clone(), metadata(3, temperature=0.0, logprobs=0))
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.logprob_token_ids.shape == (3, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1))


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """bool [n, vocab] -> int32 [n, ceil(vocab / 32)], bit j of word j // 32."""
    n, vocab = allowed.shape
    padded = np.zeros((n, cdiv(vocab, 32) * 32), bool)
    padded[:, :vocab] = allowed
    weights = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint64)
    words = (padded.reshape(n, -1, 32).astype(np.uint64) * weights).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def test_grammar_bitmask_masks_disallowed_tokens() -> None:
    n = 400
    logits = logits_rows(n, seed=15)
    rng = np.random.default_rng(0)
    allowed = rng.random((2, VOCAB)) < 0.2
    allowed[:, 33] = True  # a token of the second word, to exercise the bit order
    rows = np.array([5, 7])
    apply_grammar_bitmask(logits, rows, pack_bitmask(allowed), ["a", "b"])
    assert torch.isinf(logits[5][~torch.from_numpy(allowed[0])]).all()
    assert torch.isfinite(logits[5][torch.from_numpy(allowed[0])]).all()
    assert torch.isfinite(logits[0]).all()  # rows without a bitmask are untouched
    tokens = sample(logits[[5] * (n // 2) + [7] * (n // 2)], metadata(n, temperature=5.0))
    assert set(tokens[: n // 2].tolist()) <= set(np.flatnonzero(allowed[0]).tolist())
    assert set(tokens[n // 2 :].tolist()) <= set(np.flatnonzero(allowed[1]).tolist())
    assert 33 in tokens.tolist()


def test_grammar_bitmask_on_every_row_masks_in_place() -> None:
    """Rows 0..n-1 in order: the logits are masked where they are, no gather."""
    rng = np.random.default_rng(1)
    allowed = rng.random((3, VOCAB)) < 0.3
    allowed[:, 31] = True  # the sign bit of a word
    logits = logits_rows(3, seed=16)
    before = logits.clone()
    apply_grammar_bitmask(logits, np.arange(3), pack_bitmask(allowed), ["a", "b", "c"])
    mask = torch.from_numpy(allowed)
    assert torch.isinf(logits[~mask]).all()
    assert torch.equal(logits[mask], before[mask])


def test_grammar_bitmask_errors() -> None:
    logits = torch.zeros(2, VOCAB)
    with pytest.raises(ValueError, match="allows no token for req-b"):
        none_allowed = pack_bitmask(np.array([[True] * VOCAB, [False] * VOCAB]))
        apply_grammar_bitmask(logits, np.array([0, 1]), none_allowed, ["req-a", "req-b"])
    vocab = 50  # a last word of 18 tokens: its other bits are past the vocabulary
    past_vocab = np.zeros((2, 2), np.int32)
    past_vocab[0, 1] = 1 << 17  # the vocabulary's last token
    past_vocab[1, 1] = 1 << 18  # the first one past it
    odd = torch.zeros(2, vocab)
    with pytest.raises(ValueError, match="allows no token for past"):
        apply_grammar_bitmask(odd, np.array([0, 1]), past_vocab, ["last", "past"])
    apply_grammar_bitmask(odd, np.array([0]), past_vocab[:1], ["last"])
    assert torch.isfinite(odd[0]).sum() == 1 and torch.isfinite(odd[0, vocab - 1])
    with pytest.raises(ValueError, match="grammar bitmask must be int32"):
        apply_grammar_bitmask(logits, np.array([0]), np.zeros((1, 3), np.int32), ["x"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_bitmask_kernel_bans_what_the_torch_ops_ban(dtype) -> None:
    """The Triton path's upload and kernel (the interpreter on the CPU) against the torch
    ops: rows out of order, a vocabulary that ends mid-word, a bitmask narrower than it,
    and a second upload through the same buffers."""
    pytest.importorskip("triton")
    from tests.runner_helpers import DEVICE
    from zmqworker.model_runner.grammar_upload import BitmaskUpload

    vocab, n = 300, 5
    rng = np.random.default_rng(3)
    upload = BitmaskUpload(8, vocab, DEVICE)
    buffers = upload._device.data_ptr()
    for rows, width in ((np.array([4, 0, 6, 2, 5]), cdiv(vocab, 32)), (np.array([1, 3]), 7)):
        allowed = rng.random((len(rows), vocab)) < 0.3
        allowed[:, [0, 31, 32, vocab - 1]] = True  # the first, a sign bit, the last
        bitmask = np.ascontiguousarray(pack_bitmask(allowed)[:, :width])
        logits = torch.randn(n + 2, vocab, generator=torch.Generator().manual_seed(4))
        by_torch, by_kernel = logits.to(dtype), logits.to(dtype).to(DEVICE)
        names = [f"r{i}" for i in range(len(rows))]
        apply_grammar_bitmask(by_torch, rows, bitmask, names)
        apply_grammar_bitmask(by_kernel, rows, bitmask, names, upload)
        assert torch.equal(by_torch, by_kernel.cpu())
        assert torch.isinf(by_torch[rows]).any() and torch.isfinite(by_torch[rows]).any()
    assert upload._device.data_ptr() == buffers
    with pytest.raises(ValueError, match=r"shape \(9, 10\) for 9 rows does not fit \[8, 10\]"):
        upload.upload(np.arange(9), np.zeros((9, 10), np.int32))


def test_bad_logits_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(VOCAB), metadata(1))
