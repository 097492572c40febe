"""Paged attention against a dense per-request reference, over shuffled block ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zmqworker.attention import build_attention_metadata
from zmqworker.attention.paged_attention import paged_attention

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


def reference(q: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor, ctx: int, scale):
    """Dense causal attention of q (the last len(q) positions) over the history."""
    group = q.shape[1] // k_hist.shape[1]
    k = k_hist.repeat_interleave(group, dim=1)
    v = v_hist.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = ctx + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedScenario:
    """Requests with full K/V histories; runs steps through the cache and checks each."""

    def __init__(self, seq_lens: list[int], num_blocks: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        self.values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        self.queries = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
        needed = [-(-n // BLOCK) for n in seq_lens]
        ids = self.rng.permutation(num_blocks)[: sum(needed)]
        self.tables, start = [], 0
        for n in needed:
            self.tables.append(ids[start : start + n])
            start += n
        self.cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.done = [0] * len(seq_lens)

    def step(self, schedule: dict[int, int]) -> None:
        """Run one step scheduling schedule[req] new tokens per request; compare outputs."""
        reqs = list(schedule)
        query_lens = np.array([schedule[r] for r in reqs], dtype=np.int32)
        seq_lens = np.array([self.done[r] + schedule[r] for r in reqs], dtype=np.int32)
        width = max(len(self.tables[r]) for r in reqs) + 3
        # Padding entries are garbage on purpose: only the used prefix may be read.
        tables = self.rng.integers(-5, 10_000, size=(len(reqs), width)).astype(np.int32)
        slots, q, k, v = [], [], [], []
        for row, r in enumerate(reqs):
            tables[row, : len(self.tables[r])] = self.tables[r]
            pos = np.arange(self.done[r], self.done[r] + schedule[r])
            slots.append(self.tables[r][pos // BLOCK] * BLOCK + pos % BLOCK)
            q.append(self.queries[r][pos])
            k.append(self.keys[r][pos])
            v.append(self.values[r][pos])
        meta = build_attention_metadata(
            query_lens, seq_lens, tables, np.concatenate(slots).astype(np.int64), BLOCK,
            torch.device("cpu"),
        )
        scale = HEAD_DIM**-0.5
        out = paged_attention(torch.cat(q), torch.cat(k), torch.cat(v), self.cache, meta, scale)
        start = 0
        for r, n in schedule.items():
            end = self.done[r] + n
            expected = reference(
                self.queries[r][self.done[r] : end], self.keys[r][:end], self.values[r][:end],
                self.done[r], scale,
            )
            torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
            start += n
            self.done[r] = end


def test_single_fresh_prefill_then_decodes():
    s = PagedScenario([13])
    s.step({0: 10})
    s.step({0: 1})
    s.step({0: 1})
    s.step({0: 1})


def test_mixed_prefill_chunked_prefill_and_decode_in_one_step():
    s = PagedScenario([10, 17, 7, 12])
    s.step({0: 8, 1: 5})  # two fresh prefills of different lengths
    s.step({0: 1, 1: 7, 2: 6})  # decode + second chunk + fresh prefill
    s.step({3: 7, 1: 5, 0: 1})  # fresh prefill, last chunk, decode; not in request order
    s.step({3: 5, 2: 1})  # last chunk + decode


@pytest.mark.parametrize("lens", [[20, 20, 20], [5, 17, 9, 30]])
def test_decode_only_batches_uniform_and_ragged(lens):
    s = PagedScenario(lens, num_blocks=40)
    s.step({r: n - 3 for r, n in enumerate(lens)})
    for _ in range(3):
        s.step({r: 1 for r in range(len(lens))})


def test_equal_chunks_take_the_unpadded_path():
    s = PagedScenario([16, 16])
    s.step({0: 8, 1: 8})
    s.step({0: 8, 1: 8})


def test_metadata_rejects_inconsistent_inputs():
    cpu = torch.device("cpu")
    tables = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="shorter than query_lens"):
        build_attention_metadata(np.array([3]), np.array([2]), tables, np.zeros(3), BLOCK, cpu)
    with pytest.raises(ValueError, match="slot_mapping"):
        build_attention_metadata(np.array([3]), np.array([3]), tables, np.zeros(2), BLOCK, cpu)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        build_attention_metadata(np.array([1]), np.array([17]), tables, np.zeros(1), BLOCK, cpu)
    with pytest.raises(ValueError, match=">= 1 query token"):
        build_attention_metadata(np.array([0]), np.array([3]), tables, np.zeros(0), BLOCK, cpu)


def test_cache_of_wrong_shape_is_rejected():
    meta = build_attention_metadata(
        np.array([2]), np.array([2]), np.zeros((1, 1), np.int32), np.arange(2), BLOCK,
        torch.device("cpu"),
    )
    q, kv = torch.zeros(2, HEADS, HEAD_DIM), torch.zeros(2, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="KV cache shape"):
        paged_attention(q, kv, kv, torch.zeros(2, 4, BLOCK, KV_HEADS + 1, HEAD_DIM), meta, 1.0)
