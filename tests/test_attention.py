"""Paged attention against a dense per-request reference, over shuffled block ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zmqworker.attention.decode as decode
import zmqworker.attention.paged_attention as paged
from zmqworker.attention import build_attention_metadata
from zmqworker.attention.decode import AttentionGeometry, build_bag_plan
from zmqworker.attention.kv_cache import allocate_kv_cache, kv_cache_shape
from zmqworker.attention.paged_attention import paged_attention, probe_steps
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
# float32 decodes on embedding bags, bfloat16 through a gather and SDPA.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def metadata(query_lens, seq_lens, tables, slots, dtype=torch.float32, workspace=None):
    geometry = AttentionGeometry(HEADS, KV_HEADS, HEAD_DIM, dtype)
    return build_attention_metadata(
        np.asarray(query_lens),
        np.asarray(seq_lens),
        tables,
        np.asarray(slots),
        BLOCK,
        geometry,
        workspace or GatherWorkspace(),
        torch.device("cpu"),
    )


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
    """Requests with full K/V histories; runs steps through the cache and checks each.

    With shared_blocks=k every request's first k blocks are request 0's (a cached prefix,
    same ids and contents); the others start with those k * BLOCK tokens already computed,
    so request 0 must write them first."""

    def __init__(
        self,
        seq_lens: list[int],
        num_blocks: int = 64,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        shared_blocks: int = 0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype

        def rand(*shape: int) -> torch.Tensor:  # values the cache dtype holds exactly
            return torch.randn(*shape, generator=gen).to(dtype).float()

        self.keys = [rand(n, KV_HEADS, HEAD_DIM) for n in seq_lens]
        self.values = [rand(n, KV_HEADS, HEAD_DIM) for n in seq_lens]
        self.queries = [rand(n, HEADS, HEAD_DIM) for n in seq_lens]
        shared = shared_blocks * BLOCK
        for r in range(1, len(seq_lens)):
            self.keys[r][:shared] = self.keys[0][:shared]
            self.values[r][:shared] = self.values[0][:shared]
        needed = [cdiv(n, BLOCK) - (shared_blocks if r else 0) for r, n in enumerate(seq_lens)]
        ids = self.rng.permutation(num_blocks)[: sum(needed)]
        self.tables, start = [], 0
        for r, n in enumerate(needed):
            own = ids[start : start + n]
            self.tables.append(np.concatenate([self.tables[0][:shared_blocks], own]) if r else own)
            start += n
        self.cache = allocate_kv_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu")
        self.done = [0] + [shared] * (len(seq_lens) - 1)

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
        meta = metadata(
            query_lens, seq_lens, tables, np.concatenate(slots).astype(np.int64), self.dtype
        )
        scale = HEAD_DIM**-0.5
        q, k, v = (torch.cat(t).to(self.dtype) for t in (q, k, v))
        out = paged_attention(q, k, v, self.cache, meta, scale)
        assert out.dtype == self.dtype
        tol = TOLERANCE[self.dtype]
        start = 0
        for r, n in schedule.items():
            end = self.done[r] + n
            expected = reference(
                self.queries[r][self.done[r] : end],
                self.keys[r][:end],
                self.values[r][:end],
                self.done[r],
                scale,
            )
            torch.testing.assert_close(out[start : start + n].float(), expected, atol=tol, rtol=tol)
            start += n
            self.done[r] = end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_fresh_prefill_then_decodes(dtype):
    s = PagedScenario([13], dtype=dtype)
    s.step({0: 10})
    s.step({0: 1})
    s.step({0: 1})
    s.step({0: 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_chunked_prefill_and_decode_in_one_step(dtype):
    s = PagedScenario([10, 17, 7, 12, 3], dtype=dtype)
    s.step({0: 8, 1: 5, 4: 1})  # two fresh prefills of different lengths, a 1-token prompt
    s.step({0: 1, 1: 7, 2: 6, 4: 1})  # decode + second chunk + fresh prefill + decode
    s.step({3: 7, 1: 5, 0: 1})  # fresh prefill, last chunk, decode; not in request order
    s.step({3: 5, 2: 1})  # last chunk + decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[20, 20, 20], [5, 17, 9, 30]])
def test_decode_only_batches_uniform_and_ragged(lens, dtype):
    s = PagedScenario(lens, num_blocks=40, dtype=dtype)
    s.step({r: n - 3 for r, n in enumerate(lens)})
    for _ in range(3):
        s.step({r: 1 for r in range(len(lens))})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requests_sharing_cached_prefix_blocks(dtype):
    """Prefix caching: several requests read the same blocks in one step."""
    s = PagedScenario([14, 13, 17, 12], shared_blocks=2, dtype=dtype)
    s.step({0: 12})
    s.step({1: 1, 2: 6, 3: 3, 0: 1})  # a decode right after the prefix, prefills after it
    s.step({r: 1 for r in range(4)})


def test_long_history_is_attended_in_row_slices(monkeypatch):
    monkeypatch.setattr(paged, "PREFILL_MASK_ELEMENTS", 64)  # 2-3 query rows per slice
    s = PagedScenario([30, 25])
    s.step({0: 9, 1: 4})
    s.step({0: 11, 1: 12})  # each over its history, in several slices


def test_gather_blocks_returns_keys_and_values_in_block_order():
    s = PagedScenario([8])
    s.step({0: 8})
    ids = torch.from_numpy(s.tables[0].astype(np.int64))
    keys, values = GatherWorkspace().gather(s.cache, ids, HEAD_DIM)
    assert keys.shape == values.shape == (KV_HEADS, 8, HEAD_DIM)
    torch.testing.assert_close(keys, s.keys[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(values, s.values[0].transpose(0, 1), rtol=0, atol=0)


def test_bag_indices_widen_to_int64_for_huge_caches():
    tables = np.array([[2**27]], np.int64)  # row ids past 2**31
    plan = build_bag_plan(tables, np.array([3]), BLOCK, KV_HEADS, HEADS, HEAD_DIM, "cpu")
    assert plan.key_index.dtype == plan.value_index.dtype == torch.int64
    last_key_row = (2**27 * KV_HEADS + KV_HEADS - 1) * HEAD_DIM + HEAD_DIM - 1
    assert int(plan.key_index.max()) == last_key_row
    small = build_bag_plan(tables // 2**20, np.array([3]), BLOCK, KV_HEADS, HEADS, HEAD_DIM, "cpu")
    assert small.key_index.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_requests_attended_in_chunks(monkeypatch, dtype):
    monkeypatch.setattr(decode, "CHUNK_POSITIONS", 24)  # one or two requests per chunk
    lens = [6, 17, 9, 5, 11]
    s = PagedScenario(lens, dtype=dtype)
    s.step({r: n - 4 for r, n in enumerate(lens)})
    s.step({r: 1 for r in range(5)})  # decode only: the chunks make up the whole step
    s.step({0: 1, 1: 3, 3: 1, 2: 1, 4: 1})  # decodes around a prefill, out of order


def test_chunks_bound_padded_positions_unless_one_request_is_longer(monkeypatch):
    monkeypatch.setattr(decode, "CHUNK_POSITIONS", 32)
    # padded to blocks of 4: 8, 4, 12, 40, 4, 4 -> widest * count <= 32 per chunk
    chunks = decode.chunk_requests(np.array([5, 3, 12, 37, 1, 2]), BLOCK)
    assert chunks == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_probe_steps_stay_within_the_scheduler_limits():
    steps = probe_steps(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=100, block_size=4)
    (decode_q, decode_ctx), (prefill_q, prefill_ctx) = steps
    assert decode_q.tolist() == [1] * 6 and decode_ctx.tolist() == [99] * 6
    assert prefill_q.tolist() == [6] and prefill_ctx.tolist() == [94]
    long = probe_steps(
        max_num_seqs=64, max_num_batched_tokens=1 << 20, max_model_len=1 << 12, block_size=16
    )
    rows = paged.PREFILL_MASK_ELEMENTS >> 12  # one full mask slice at max_model_len
    assert long[1][0].tolist() == [rows] and long[1][1].tolist() == [(1 << 12) - rows]
    assert len(long[0][0]) == decode.CHUNK_POSITIONS >> 12  # one full decode chunk
    assert len(probe_steps(4, 1, 50, 4)) == 1  # one-token steps hold no prefill


def test_metadata_rejects_inconsistent_inputs():
    tables = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="shorter than query_lens"):
        metadata([3], [2], tables, np.zeros(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        metadata([3], [3], tables, np.zeros(2))
    with pytest.raises(ValueError, match="needs 5 blocks"):
        metadata([1], [17], tables, np.zeros(1))
    with pytest.raises(ValueError, match=">= 1 query token"):
        metadata([0], [3], tables, np.zeros(0))


def test_cache_of_wrong_shape_or_dtype_is_rejected():
    meta = metadata([2], [2], np.zeros((1, 1), np.int32), np.arange(2))
    q, kv = torch.zeros(2, HEADS, HEAD_DIM), torch.zeros(2, KV_HEADS, HEAD_DIM)
    wrong_heads = torch.zeros(kv_cache_shape(4, BLOCK, KV_HEADS + 1, HEAD_DIM))
    with pytest.raises(ValueError, match="KV cache shape"):
        paged_attention(q, kv, kv, wrong_heads, meta, 1.0)
    half = torch.zeros(kv_cache_shape(4, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q, kv, kv, half, meta, 1.0)
