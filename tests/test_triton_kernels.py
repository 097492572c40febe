"""The Triton kernels of the CUDA step against the plain-torch path and a dense reference.

Without a GPU they run in Triton's interpreter on CPU tensors (float32 and float16 are
exact there; bfloat16 is not, so it is checked with ZMQWORKER_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from zmqworker.attention import triton_metadata  # noqa: E402
from zmqworker.attention.head_norms import HeadNorms  # noqa: E402
from zmqworker.attention.kv_cache import allocate_kv_cache, write_kv  # noqa: E402
from zmqworker.attention.triton_attention import (  # noqa: E402
    decode_attention,
    paged_attention,
    varlen_attention,
)
from zmqworker.attention.triton_cache import rope_and_cache  # noqa: E402
from zmqworker.attention.triton_metadata import (  # noqa: E402
    FEW_SPLITS,
    MAX_DECODE_SPLITS,
    MERGE_TILE,
    TritonAttentionMetadata,
    decode_splits,
    merge_chunk,
    split_length,
)
from zmqworker.cdiv import cdiv
from zmqworker.models.layers import skinny_linear as skinny  # noqa: E402
from zmqworker.models.layers.linear import SkinnyPath  # noqa: E402
from zmqworker.models.layers.norm import RMSNorm  # noqa: E402
from zmqworker.models.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from zmqworker.models.layers.skinny_gate_up import MAX_ROWS, gate_up_silu  # noqa: E402
from zmqworker.models.layers.triton_ops import rms_norm, silu_and_mul  # noqa: E402
from zmqworker.pdl import ENABLED as PDL_ENABLED  # noqa: E402
from zmqworker.pdl import launch_options  # noqa: E402

DEVICE = torch.device(os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu"))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HEAD_DIM = 16
# Rotary is exact in the interpreter; compiled, a product may fuse into an FMA (one
# rounding fewer).
ROTARY_ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def dense_reference(q, keys, values, context, scale):
    """q [n, heads, d] at positions context.., keys/values [seq, kv_heads, d]: causal."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = context + torch.arange(q.shape[0], device=q.device)[:, None]
    hidden = torch.arange(k.shape[0], device=q.device)[None, :] > q_pos
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def rotary_table(dtype, positions=256):
    return RotaryEmbedding(HEAD_DIM, positions, {"rope_theta": 10000.0}, positions, dtype).to(
        DEVICE
    )


def head_norms(dtype, seed=9):
    """Qwen3-style q and k norms of random weights: (the torch layers, HeadNorms)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [RMSNorm(HEAD_DIM, 1e-6, name).to(DEVICE, dtype) for name in ("q", "k")]
    for layer in layers:
        layer.weight.data = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(dtype).to(DEVICE)
    return layers, HeadNorms(layers[0].weight, layers[1].weight, 1e-6)


def new_tokens(num_tokens, heads, kv_heads, dtype, positions, rotary, seed=7, norms=None):
    """Raw q/k/v of a step's tokens [num_tokens, heads + 2 * kv_heads, HEAD_DIM], and
    what torch makes of them, each head normalised first by norms (the torch q and k
    layers) where given: (qkv, rotated queries, rotated keys, values)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, HEAD_DIM, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    cos, sin = rotary.lookup(torch.as_tensor(positions, dtype=torch.int64, device=DEVICE))
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return qkv, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[:, heads + kv_heads :]


class Step:
    """Requests of (context, new tokens) with random histories in shuffled blocks, the
    whole history already written into the cache (as the cache kernel leaves it)."""

    def __init__(self, reqs, heads, kv_heads, block_size, dtype, seed=0, num_blocks=None):
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.reqs, self.heads, self.kv_heads, self.dtype = reqs, heads, kv_heads, dtype
        seq_lens = [c + n for c, n in reqs]
        need = [cdiv(s, block_size) for s in seq_lens]
        num_blocks = num_blocks or sum(need) + 5
        ids = rng.permutation(num_blocks)[: sum(need)]
        width = max(need) + 2
        # Entries past a request's blocks are garbage on purpose: they must not be read.
        self.tables = rng.integers(0, num_blocks, size=(len(reqs), width)).astype(np.int32)
        start = 0
        self.cache = allocate_kv_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, DEVICE)
        self.cache.normal_(generator=None)
        self.keys, self.values, self.queries = [], [], []
        for r, (seq, n) in enumerate(zip(seq_lens, need, strict=True)):
            self.tables[r, :n] = ids[start : start + n]
            start += n
            k = torch.randn(seq, kv_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
            v = torch.randn(seq, kv_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
            pos = np.arange(seq)
            blocks = torch.from_numpy(self.tables[r][pos // block_size].astype(np.int64))
            offsets = torch.from_numpy(pos % block_size)
            write_kv(self.cache, k, v, blocks.to(DEVICE), offsets.to(DEVICE))
            self.keys.append(k)
            self.values.append(v)
            q = torch.randn(reqs[r][1], heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
            self.queries.append(q)
        self.seq_lens = seq_lens
        self.block_size = block_size

    def metadata(self, num_splits=1, positions=None, slots=None):
        query_lens = [n for _, n in self.reqs]
        start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        num_tokens = int(start[-1])

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(DEVICE)

        return TritonAttentionMetadata(
            num_tokens=num_tokens,
            num_reqs=len(self.reqs),
            max_query_len=max(query_lens),
            decode_only=all(n == 1 for n in query_lens),
            num_splits=num_splits,
            slot_mapping=dev(np.full(num_tokens, -1) if slots is None else slots),
            positions=dev(np.zeros(num_tokens) if positions is None else positions),
            query_start_loc=dev(start),
            seq_lens=dev(self.seq_lens),
            block_tables=dev(self.tables),
        )

    def check(self, out):
        scale = HEAD_DIM**-0.5
        tol = TOLERANCE[self.dtype]
        start = 0
        for r, (context, n) in enumerate(self.reqs):
            expected = dense_reference(
                self.queries[r], self.keys[r], self.values[r], context, scale
            )
            got = out[start : start + n].double()
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
            start += n

    def run(self):
        """The varlen kernel over the history the cache already holds."""
        meta = self.metadata()
        q = torch.cat(self.queries)
        out = varlen_attention(q, self.cache, meta, HEAD_DIM**-0.5)
        assert out.shape == q.shape and out.dtype == self.dtype
        self.check(out)

    def last_slots(self):
        """Each request's last position and the cache slot the block table gives it."""
        positions = np.array(self.seq_lens) - 1
        blocks = self.tables[np.arange(len(self.reqs)), positions // self.block_size]
        return positions, blocks * self.block_size + positions % self.block_size

    def run_decode(self, num_splits, fused=True, with_norms=False):
        """A decode step from raw (unrotated) q/k/v: the kernel rotates the queries and the
        new keys (normalising each head first, with_norms), writes the new keys and values
        (garbage in their slots until then) and attends; paged_attention takes the same
        path. Checked against torch's norms and rotary then dense attention, and the cache
        against torch's write."""
        heads, kv_heads = self.heads, self.kv_heads
        positions, slots = self.last_slots()
        rotary = rotary_table(self.dtype, max(256, max(self.seq_lens)))
        layers, norms = head_norms(self.dtype) if with_norms else (None, None)
        qkv, q_rot, k_rot, v = new_tokens(
            len(self.reqs), heads, kv_heads, self.dtype, positions, rotary, norms=layers
        )
        for r in range(len(self.reqs)):
            self.queries[r] = q_rot[r : r + 1]
            self.keys[r][-1], self.values[r][-1] = k_rot[r], v[r]
        blocks = torch.from_numpy(slots // self.block_size).to(DEVICE)
        offsets = torch.from_numpy(slots % self.block_size).to(DEVICE)
        expected_cache = self.cache.clone()
        write_kv(expected_cache, k_rot, v, blocks, offsets)
        write_kv(self.cache, torch.randn_like(k_rot), torch.randn_like(v), blocks, offsets)
        meta = self.metadata(num_splits, positions, slots)
        attend = paged_attention if fused else decode_attention
        out = attend(qkv, heads, rotary.cos_sin, self.cache, meta, HEAD_DIM**-0.5, norms)
        assert out.shape == (len(self.reqs), heads, HEAD_DIM) and out.dtype == self.dtype
        self.check(out)
        ulp = ROTARY_ULP[self.dtype]
        torch.testing.assert_close(self.cache, expected_cache, atol=ulp, rtol=ulp)


GQA = [(4, 4), (6, 2), (8, 2)]  # group sizes 1, 3 and 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_varlen_prefill_chunks_and_decodes_in_one_step(dtype, heads, kv_heads):
    # Fresh prompts, a chunk over a cached prefix that ends mid-block, decodes.
    reqs = [(0, 13), (9, 7), (22, 1), (0, 1), (5, 1), (17, 40)]
    Step(reqs, heads, kv_heads, block_size=4, dtype=dtype).run()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16, 128])  # gathered, one page, part of a page
def test_varlen_long_prefill_spans_many_tiles(dtype, block_size):
    Step([(3, 70), (0, 65)], 6, 2, block_size=block_size, dtype=dtype, seed=1).run()


# Every head grouping at the first dtype; the others at the largest group only: the
# grouping is index arithmetic, the same at every dtype, and each dtype still meets
# every split count and page size.
DECODE_HEADS = [(DTYPES[0], *g) for g in GQA] + [(d, *GQA[-1]) for d in DTYPES[1:]]


@pytest.mark.parametrize("dtype,heads,kv_heads", DECODE_HEADS)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_kernel_with_and_without_splits(dtype, heads, kv_heads, num_splits, block_size):
    # Last positions first in a page, mid-page, last in a page; one in an empty history.
    reqs = [(c, 1) for c in (0, 3, 31, 64, 99, 200)]
    step = Step(reqs, heads, kv_heads, block_size=block_size, dtype=dtype, seed=2)
    step.run_decode(num_splits, fused=num_splits != 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_normalises_each_query_and_key_head_first(dtype, num_splits):
    # Qwen3's q and k norms inside the kernel: the queries of every split and the key the
    # last split writes.
    reqs = [(c, 1) for c in (0, 17, 70)]
    step = Step(reqs, 8, 2, block_size=16, dtype=dtype, seed=5)
    step.run_decode(num_splits, with_norms=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_norms_over_a_head_dim_below_its_power_of_two(dtype):
    # 24 dims run in tiles of 32 (decode) and halves of 16 (rope_and_cache): the padding
    # must add nothing to a head's sum of squares.
    head_dim, heads, kv_heads, n = 24, 4, 2, 5
    gen = torch.Generator().manual_seed(10)
    rotary = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0}, 64, dtype).to(DEVICE)
    layers = [RMSNorm(head_dim, 1e-6, name).to(DEVICE, dtype) for name in ("q", "k")]
    for layer in layers:
        layer.weight.data = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(DEVICE)
    norms = HeadNorms(layers[0].weight, layers[1].weight, 1e-6)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.arange(3, 3 + n, device=DEVICE)
    cos, sin = rotary.lookup(positions)
    q_ref = apply_rotary(layers[0](qkv[:, :heads]), cos, sin)
    k_ref = apply_rotary(layers[1](qkv[:, heads : heads + kv_heads]), cos, sin)
    cache = allocate_kv_cache(4, 4, kv_heads, head_dim, dtype, DEVICE)
    expected_cache = cache.clone()
    slots = torch.arange(n, device=DEVICE)
    write_kv(expected_cache, k_ref, qkv[:, heads + kv_heads :], slots // 4, slots % 4)
    rope_and_cache(qkv, heads, kv_heads, rotary.cos_sin, positions.int(), slots.int(), cache, norms)
    ulp = ROTARY_ULP[dtype]
    torch.testing.assert_close(qkv[:, :heads], q_ref, atol=ulp, rtol=ulp)
    torch.testing.assert_close(cache, expected_cache, atol=ulp, rtol=ulp)


def test_head_norms_of_another_shape_or_dtype_are_refused():
    step = Step([(10, 1)], 4, 2, block_size=4, dtype=torch.float32, seed=4)
    qkv = torch.randn(1, 8, HEAD_DIM, device=DEVICE)
    table = rotary_table(torch.float32).cos_sin
    good = torch.ones(HEAD_DIM, device=DEVICE)
    for bad in (torch.ones(HEAD_DIM + 1, device=DEVICE), good.half()):
        with pytest.raises(ValueError, match="the k head norm's weight"):
            decode_attention(
                qkv, 4, table, step.cache, step.metadata(), 1.0, HeadNorms(good, bad, 1e-6)
            )
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    strided = torch.ones(2 * HEAD_DIM, device=DEVICE)[::2]  # [HEAD_DIM], not contiguous
    for bad in (good.repeat(2), strided):
        with pytest.raises(ValueError, match="the q head norm's weight"):
            rope_and_cache(qkv, 4, 2, table, slots, slots, step.cache, HeadNorms(bad, good, 1e-6))


def test_decode_padding_rows_give_zeros_and_write_nothing():
    step = Step([(10, 1), (20, 1)], 6, 2, block_size=4, dtype=torch.float32, seed=3)
    positions, slots = step.last_slots()
    meta = step.metadata(2, positions, slots)

    def pad(t, value):
        return torch.cat([t, torch.full((2,), value, dtype=torch.int32, device=DEVICE)])

    # Two padding rows, as a CUDA graph of four replays a step of two: seq_len 0, slot -1.
    padded = TritonAttentionMetadata(
        4, 4, 1, True, 2, pad(meta.slot_mapping, -1), pad(meta.positions, 0),
        torch.arange(5, dtype=torch.int32, device=DEVICE), pad(meta.seq_lens, 0),
        torch.cat([meta.block_tables, meta.block_tables]),
    )  # fmt: skip
    rotary = rotary_table(torch.float32)
    qkv, _, k_rot, v = new_tokens(4, 6, 2, torch.float32, np.append(positions, [0, 0]), rotary)
    expected_cache = step.cache.clone()
    blocks = torch.from_numpy(slots // 4).to(DEVICE)
    write_kv(expected_cache, k_rot[:2], v[:2], blocks, torch.from_numpy(slots % 4).to(DEVICE))
    out = decode_attention(qkv, 6, rotary.cos_sin, step.cache, padded, HEAD_DIM**-0.5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    torch.testing.assert_close(step.cache, expected_cache, atol=1e-6, rtol=1e-6)


def test_decode_attention_refuses_steps_of_more_tokens_than_requests():
    step = Step([(10, 3)], 4, 2, block_size=4, dtype=torch.float32, seed=4)
    qkv = torch.randn(3, 8, HEAD_DIM, device=DEVICE)
    table = rotary_table(torch.float32).cos_sin
    with pytest.raises(ValueError, match="one token per request"):
        decode_attention(qkv, 4, table, step.cache, step.metadata(), HEAD_DIM**-0.5)


def test_kernels_launch_dependently_on_hopper_and_newer_only():
    # gdc_wait needs sm_90; the interpreter and the CPU have no launch to overlap.
    assert launch_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    if DEVICE.type == "cuda":
        on = PDL_ENABLED and torch.cuda.get_device_capability(DEVICE)[0] >= 9
        assert launch_options(DEVICE) == {"PDL": on, "launch_pdl": on}


def test_only_a_lone_request_over_whole_pages_asks_its_history_ahead():
    """triton_metadata.asks_ahead: one request (measured faster; 64 slower), pages of a
    power of two, a table whose rows are its stride apart."""
    tables = torch.zeros(2, 8, dtype=torch.int32)
    assert triton_metadata.PREFETCH_REQS == 1
    assert triton_metadata.asks_ahead(1, 16, tables[:1])
    assert not triton_metadata.asks_ahead(2, 16, tables)
    assert not triton_metadata.asks_ahead(1, 24, tables[:1])
    assert not triton_metadata.asks_ahead(1, 16, tables[:1, ::2])


def test_decode_splits_fill_the_gpu_and_stay_powers_of_two():
    # Long histories: one request at batch 1 spreads over as many programs as a batch.
    assert decode_splits(1, 8, max_model_len=32768, tile=16) == 128
    assert decode_splits(4, 8, max_model_len=32768, tile=16) == 32
    assert decode_splits(1, 3, max_model_len=32768, tile=16) == 256
    assert decode_splits(64, 8, max_model_len=32768, tile=16) == 2
    assert decode_splits(128, 8, max_model_len=32768, tile=16) == 1
    # A short max_model_len caps them at what its longest history can use.
    assert decode_splits(1, 8, max_model_len=1040, tile=16) == 32
    assert decode_splits(1, 8, max_model_len=4096, tile=16) == 64
    assert decode_splits(1, 8, max_model_len=48, tile=16) == 2  # no more than its tiles


def test_a_short_history_keeps_a_few_splits_whatever_the_split_count():
    """Past FEW_SPLITS splits a split holds at least 64 positions: a short history
    works in at most FEW_SPLITS of them, a long one in all."""
    for seq_len in (1, 16, 100, 552, 1024, 2048):
        for splits in (64, 128, 256):
            length = split_length(seq_len, splits, 16)
            assert length % 16 == 0 and cdiv(seq_len, length) <= FEW_SPLITS
            assert length == split_length(seq_len, FEW_SPLITS, 16)
    assert split_length(8192, 128, 16) == 64 and split_length(32768, 128, 16) == 256
    assert cdiv(32768 + 37, split_length(32768 + 37, 64, 512)) == 33
    assert split_length(552, 16, 16) == 48  # splits below FEW_SPLITS
    assert split_length(0, 4, 16) == 16


def test_decode_of_one_long_history_merges_its_working_splits(monkeypatch):
    """One request of 32k positions of a small head over 64 splits: 33 working splits of
    1024 positions (31 idle), merged into one output. Pages and tiles of 512 positions
    keep the interpreter's loop short."""
    from zmqworker.attention import triton_attention

    monkeypatch.setattr(triton_attention, "tile_size", lambda block_size: block_size)
    step = Step([(32768 + 36, 1)], 4, 1, block_size=512, dtype=torch.float32, seed=5)
    step.run_decode(64)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter takes minutes at this size")
def test_decode_of_long_histories_at_the_8b_shapes_split_count():
    """Llama-3-8B's heads (32 over 8 kv heads) at batch 1 with 32k positions, in pages
    and tiles of 16: the 128 splits that fill an H200, merged over slices of the head
    dim."""
    splits = decode_splits(1, 8, max_model_len=32768 + 64, tile=16)
    assert splits == 128
    reqs = [(32768 + 20, 1)]
    Step(reqs, 32, 8, block_size=16, dtype=torch.bfloat16, seed=7).run_decode(splits)
    reqs = [(32768 + 20, 1), (8192, 1), (700, 1), (0, 1)]
    Step(reqs, 32, 8, block_size=16, dtype=torch.bfloat16, seed=8).run_decode(32)


def test_decode_mixes_short_and_long_histories_in_a_launch():
    """At 32 splits, short requests work in a few splits (or one), the long ones in most
    of them; an empty history (a padding row) gives zeros."""
    reqs = [(3, 1), (700, 1), (1100, 1), (0, 1), (2100, 1)]
    assert [cdiv(c + 1, split_length(c + 1, 32, 64)) for c, _ in reqs] == [1, 11, 18, 1, 17]
    Step(reqs, 3, 1, block_size=64, dtype=torch.float32, seed=6).run_decode(32)


def test_decode_merges_the_widest_split_count_over_slices_of_the_head_dim(monkeypatch):
    """256 splits, each working over one tile: the merge takes each head's partials in
    slices of the head dim (merge_chunk; a smaller tile here, for the small head), each
    slice from all 256 of them."""
    assert merge_chunk(2, 128) == 128 and merge_chunk(256, 128) == MERGE_TILE // 256
    monkeypatch.setattr(triton_metadata, "MERGE_TILE", 1024)
    assert merge_chunk(MAX_DECODE_SPLITS, HEAD_DIM) == HEAD_DIM // 4
    seq_len = MAX_DECODE_SPLITS * 64
    assert split_length(seq_len, MAX_DECODE_SPLITS, 64) == 64
    step = Step([(seq_len - 1, 1), (100, 1)], 4, 2, block_size=64, dtype=torch.float16, seed=9)
    step.run_decode(MAX_DECODE_SPLITS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("with_norms", [False, True])
def test_rope_and_cache_matches_rotary_then_write(dtype, heads, kv_heads, block_size, with_norms):
    gen = torch.Generator().manual_seed(4)
    n, num_blocks = 11, 8
    rotary = RotaryEmbedding(HEAD_DIM, 64, {"rope_theta": 10000.0}, 64, dtype).to(DEVICE)
    qkv = torch.randn(n, heads + 2 * kv_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 64, (n,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(DEVICE)
    slots[3] = -1  # a padding token: written nowhere
    expected_cache = allocate_kv_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, DEVICE)
    cos, sin = rotary.lookup(positions)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    layers, norms = head_norms(dtype) if with_norms else (None, None)
    if layers is not None:  # Qwen3's q and k norms, applied by the kernel first
        q, k = layers[0](q), layers[1](k)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keep = slots >= 0
    write_kv(
        expected_cache,
        k_ref[keep],
        qkv[keep, heads + kv_heads :],
        slots[keep] // block_size,
        slots[keep] % block_size,
    )
    cache = allocate_kv_cache(num_blocks, block_size, kv_heads, HEAD_DIM, dtype, DEVICE)
    rope_and_cache(qkv, heads, kv_heads, rotary.cos_sin, positions.int(), slots.int(), cache, norms)
    ulp = ROTARY_ULP[dtype]
    torch.testing.assert_close(qkv[:, :heads], q_ref, atol=ulp, rtol=ulp)
    torch.testing.assert_close(cache, expected_cache, atol=ulp, rtol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_the_torch_layer(dtype, with_residual):
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(80, 1e-5, "norm").to(DEVICE, dtype)
    norm.weight.data = torch.randn(80, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(7, 80, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(7, 80, generator=gen).to(dtype).to(DEVICE)
    if with_residual:
        expected, expected_res = norm.add_and_norm(x, res)
        out, out_res = rms_norm(x, norm.weight, norm.eps, res)
        torch.testing.assert_close(out_res, expected_res, atol=0, rtol=0)
    else:
        expected, (out, _) = norm(x), rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_rms_norm_kernel_over_rows_of_a_strided_view():
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(5, 3 * 40, generator=gen).to(DEVICE)
    norm = RMSNorm(40, 1e-6, "norm").to(DEVICE)
    norm.weight.data = torch.rand(40, generator=gen).to(DEVICE)
    out, _ = rms_norm(wide[:, 40:80], norm.weight, norm.eps)
    torch.testing.assert_close(out, norm(wide[:, 40:80]), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"rms_norm needs x \[rows, size\]"):
        rms_norm(wide.view(5, 3, 40), norm.weight, norm.eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_and_mul(x), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_matches_the_projection_then_silu_and_mul(dtype, rows, bias):
    # 72 features and 200 inputs: neither a multiple of the kernel's tiles.
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 200, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(2 * 72, 200, generator=gen) / 200**0.5).to(dtype).to(DEVICE)
    b = torch.randn(2 * 72, generator=gen).to(dtype).to(DEVICE) if bias else None
    expected = silu_and_mul(torch.nn.functional.linear(x, weight, b))
    # The product's summation order differs from the BLAS's: one rounding of the output.
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(gate_up_silu(x, weight, b), expected, atol=ulp, rtol=ulp)


@pytest.mark.parametrize("tiles", [(64, 128, 4, 3), (64, 64, 4, 3), (16, 256, 4, 3)])
@pytest.mark.parametrize("rows", [5, 40])
def test_gate_up_silu_under_each_tile_setting_over_a_strided_input(tiles, rows):
    # x is a column slice of a wider tensor: its row stride is not its width.
    gen = torch.Generator().manual_seed(10)
    wide = torch.randn(rows, 300, generator=gen).to(torch.float16).to(DEVICE)
    x = wide[:, 50:250]
    weight = (torch.randn(2 * 72, 200, generator=gen) / 200**0.5).to(torch.float16).to(DEVICE)
    b = torch.randn(2 * 72, generator=gen).to(torch.float16).to(DEVICE)
    expected = silu_and_mul(torch.nn.functional.linear(x, weight, b))
    got = gate_up_silu(x, weight, b, tiles=tiles)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_gate_up_tiles_follow_the_sweeps_and_fit_the_shared_memory():
    """Up to 16 rows as before; from 32, four stages of 128-wide K at 64 wide, half the K
    tile where a short K leaves more 64-wide programs than the device has multiprocessors
    (132 unless given), 16 wide for
    small weights (bench/results/skinny_gate_up_sweep_h100.json). Where the stages would
    not fit a device's shared memory, fewer stages, then a narrower K tile."""
    from zmqworker.models.layers.skinny_gate_up import _tiles

    assert _tiles(16, 14336, 4096) == (64, 128, 4, 3)  # Llama-3-8B
    assert _tiles(16, 8960, 1536) == (32, 128, 4, 3)  # Qwen2.5-1.5B
    for block_m in (32, 64):
        assert _tiles(block_m, 14336, 4096) == (64, 128, 4, 4)
        assert _tiles(block_m, 8192, 2048) == (64, 128, 4, 4)  # Llama-3.2-1B: 128 programs
        assert _tiles(block_m, 8960, 1536) == (64, 64, 4, 4)  # 140 programs
        assert _tiles(block_m, 11008, 2048) == (64, 64, 4, 4)  # Qwen2.5-3B
        assert _tiles(block_m, 1536, 576) == (16, 128, 4, 4)  # SmolLM2-135M
        # The device's multiprocessors decide the second wave: 142 (an L40S) take 140
        # programs in one, 114 (an H100 PCIe) not Llama-3.2-1B's 128.
        assert _tiles(block_m, 8960, 1536, sms=142) == (64, 128, 4, 4)
        assert _tiles(block_m, 8192, 2048, sms=114) == (64, 64, 4, 4)
    hopper, ada = 227 * 1024, 99 * 1024
    assert _tiles(64, 14336, 4096, 2, hopper) == (64, 128, 4, 4)  # four stages of 48 KiB
    assert _tiles(64, 14336, 4096, 2, ada) == (64, 128, 4, 2)
    assert _tiles(32, 14336, 4096, 2, ada) == (64, 128, 4, 2)  # two of 40 KiB
    assert _tiles(64, 14336, 4096, 4, hopper) == (64, 128, 4, 2)  # float32
    assert _tiles(64, 14336, 4096, 4, ada) == (64, 64, 4, 2)
    assert _tiles(64, 14336, 4096, 4, 1024) == (64, 32, 4, 2)  # as far as it goes


def test_gate_up_silu_refuses_more_rows_than_its_tile():
    x = torch.zeros(MAX_ROWS + 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="gate_up_silu needs x"):
        gate_up_silu(x, torch.zeros(64, 32, device=DEVICE))
    with pytest.raises(ValueError, match="must be contiguous"):
        gate_up_silu(x[:2], torch.zeros(32, 64, device=DEVICE).T)
    with pytest.raises(ValueError, match="gate_up_silu needs x"):
        gate_up_silu(torch.zeros(32, device=DEVICE), torch.zeros(64, 32, device=DEVICE))


def _linear_case(dtype, rows, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    counters = torch.zeros(skinny.counter_slots(n), dtype=torch.int32, device=DEVICE)
    return x, weight, b, counters


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 20, skinny.MAX_ROWS])  # each row tile
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_the_projection(dtype, rows, bias):
    # 72 outputs and 300 inputs: neither a multiple of the tiles, and split 3 ways.
    x, weight, b, counters = _linear_case(dtype, rows, 72, 300, bias, 11)
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    got = skinny.skinny_linear(x, weight, b, counters)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), atol=ulp, rtol=ulp)
    assert not counters.any()  # left at zero for the next call


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) over K = 200: one split, three asked of four
# K steps (two run, the last one short), more splits asked than K has steps, and the
# widest tile.
@pytest.mark.parametrize(
    "tiles", [(64, 64, 1, 4, 3), (32, 64, 3, 4, 3), (32, 128, 8, 4, 3), (128, 32, 2, 4, 3)]
)
@pytest.mark.parametrize("rows", [3, skinny.MAX_ROWS])
def test_skinny_linear_under_each_tile_setting_over_a_strided_input(tiles, rows):
    x, weight, b, counters = _linear_case(torch.float16, rows, 100, 200, True, 12)
    wide = torch.zeros(rows, 300, dtype=torch.float16, device=DEVICE)
    wide[:, 50:250] = x
    expected = torch.nn.functional.linear(x, weight, b)
    for _ in range(2):  # a second call finds the counters as the first left them
        got = skinny.skinny_linear(wide[:, 50:250], weight, b, counters, tiles=tiles)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    assert not counters.any()


def test_layers_of_up_to_1536_outputs_take_narrow_two_warp_tiles():
    """Qwen2.5-1.5B's o and down (1,536 outputs) run 16 wide over two warps up to one row
    tile, the split cap counted in warps (bench/results/skinny_tiles_h100.json); past 16
    rows, and from 1,537 outputs, the wide tiles as before. Such a layer through the
    kernel equals the projection."""
    assert skinny._tiles(1536, 8960, 1) == skinny._tiles(1536, 8960, 16) == (16, 128, 8, 2, 3)
    assert skinny._tiles(1536, 1536, 32) == (64, 128, 8, 4, 3)
    assert skinny._tiles(2048, 1536, 1) == (64, 128, 8, 4, 3)
    assert skinny._tiles(4096, 4096, 1) == (64, 128, 4, 4, 3)
    # Large wide layers (the 8B's q/k/v) take 32-wide tiles, so half the splits fill
    # MAX_WARPS; a small wide one (Qwen2.5-1.5B's q/k/v, above) keeps 64.
    assert skinny._tiles(6144, 4096, 1) == skinny._tiles(6144, 4096, 16) == (32, 128, 2, 4, 3)
    x, weight, b, counters = _linear_case(torch.float32, 5, 1100, 300, True, 15)
    got = skinny.skinny_linear(x, weight, b, counters)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert not counters.any()


def test_skinny_linear_is_deterministic_across_calls():
    x, weight, _, counters = _linear_case(torch.float32, 4, 64, 512, False, 13)
    first = skinny.skinny_linear(x, weight, None, counters, tiles=(32, 64, 8, 4, 3))
    again = skinny.skinny_linear(x, weight, None, counters, tiles=(32, 64, 8, 4, 3))
    assert torch.equal(first, again)


def test_skinny_linear_refuses_what_it_cannot_run():
    x, weight, _, counters = _linear_case(torch.float32, 2, 64, 32, False, 14)
    with pytest.raises(ValueError, match="skinny_linear needs x"):
        tall = torch.zeros(skinny.MAX_ROWS + 1, 32, device=DEVICE)
        skinny.skinny_linear(tall, weight, None, counters)
    with pytest.raises(ValueError, match="must be contiguous"):
        skinny.skinny_linear(x, torch.zeros(32, 64, device=DEVICE).T, None, counters)
    with pytest.raises(ValueError, match="needs at least 4 int32 counters"):
        skinny.skinny_linear(x, weight, None, counters[:1])
    with pytest.raises(ValueError, match="below the counters' tile"):
        skinny.skinny_linear(x, weight, None, counters, tiles=(8, 32, 2, 4, 3))
    with pytest.raises(ValueError, match=r"bias \(3,\) torch.float32 on .* must be \[64\]"):
        skinny.skinny_linear(x, weight, torch.zeros(3, device=DEVICE), counters)
    with pytest.raises(ValueError, match="weight .* torch.float16 .* must be torch.float32"):
        skinny.skinny_linear(x, weight.half(), None, counters)


def test_skinny_path_takes_the_kernel_where_it_pays_and_for_decode_sized_steps():
    assert skinny.pays(576, 1536) and skinny.pays(4096, 4096)  # down, o
    assert skinny.pays(960, 576)  # SmolLM2's q/k/v: small
    # Large wide q/k/v: the 8B's, Qwen3-30B-A3B's, Llama-3.2-1B's (measured faster) ...
    assert skinny.pays(6144, 4096) and skinny.pays(5120, 2048) and skinny.pays(3072, 2048)
    # ... not Qwen2.5-7B's (measured slower), nor an o cut to a K of 1,024 (not measured).
    assert not skinny.pays(4608, 3584) and not skinny.pays(4096, 1024)
    assert SkinnyPath(4608, 3584, enabled=True).kernel is None
    # The rule's edges: exactly 1.5x as wide over a K of exactly 2,048 (and just under
    # either), and 4M elements.
    assert skinny.pays(3072, 2048)
    assert not skinny.pays(3071, 2048) and not skinny.pays(3072, 2047)
    small = skinny.SMALL_WEIGHT
    assert skinny.pays(small // 1024 - 1, 1024) and not skinny.pays(small // 1024, 1024)
    # Small weights to 32 rows, large ones to 16, as measured.
    assert skinny.row_limit(960, 576) == skinny.SMALL_WEIGHT_ROWS == 32
    assert skinny.row_limit(4096, 4096) == skinny.row_limit(6144, 4096) == 16
    assert skinny.row_limit(4608, 3584) == 0
    path = SkinnyPath(72, 300, enabled=True).to(DEVICE)
    assert path.kernel is not None and not path.counters.any()
    for rows in (3, 32, 33):  # the last one: cuBLAS
        x, weight, b, _ = _linear_case(torch.float32, rows, 72, 300, True, 15)
        want = torch.nn.functional.linear(x, weight, b)
        torch.testing.assert_close(path(x, weight, b), want, atol=1e-5, rtol=1e-5)
    off = SkinnyPath(72, 300, enabled=False)
    assert off.kernel is None and off.counters.numel() == 0


def test_k_splits_leave_no_split_empty():
    assert skinny.k_splits(1536, 128, 8) == (6, 2)  # SmolLM2's down: 12 steps
    assert skinny.k_splits(4096, 128, 4) == (4, 8)
    assert skinny.k_splits(200, 128, 8) == (2, 1)
    assert skinny.k_splits(200, 64, 3) == (2, 2)
