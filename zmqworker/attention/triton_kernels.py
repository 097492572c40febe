"""The Triton kernels of paged attention (triton_attention.py launches them): the
varlen kernel of any step, and the decode kernel, which also rotates its token's query
and key and writes its key and value, and whose splits merge in their last one. Every
kernel reads the cache in its own layout (kv_cache.py) through the block table."""

from __future__ import annotations

import triton
import triton.language as tl

from zmqworker.attention.triton_cache import rotate
from zmqworker.pdl import release_dependents, wait_for_inputs


@triton.jit
def attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    kv_ptr,
    v_offset,
    table_ptr,
    kv_head,
    start,
    end,
    q_pos,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online softmax of q's rows over history positions [start, end) of one request.

    When TILE_N divides BLOCK_SIZE (and start is a multiple of TILE_N), a tile lies in one
    page and loads as contiguous runs, unmasked: positions past `end` in the last page
    are masked after the load (their scores -inf, their values 0). Pages smaller than a
    tile's minimum are addressed position by position through the table instead."""
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    page_elems = HEAD_DIM * BLOCK_SIZE
    offs_t = tl.arange(0, TILE_N)
    for first in range(start, end, TILE_N):
        offs_n = first + offs_t
        n_ok = offs_n < end
        if BLOCK_SIZE % TILE_N == 0:
            block = tl.load(table_ptr + first // BLOCK_SIZE)
            page = (block.to(tl.int64) * NUM_KV_HEADS + kv_head) * page_elems
            slot = first % BLOCK_SIZE + offs_t
            k_ptrs = kv_ptr + page + offs_d[:, None] * BLOCK_SIZE + slot[None, :]
            v_ptrs = kv_ptr + v_offset + page + slot[:, None] * HEAD_DIM + offs_d[None, :]
            if HEAD_DIM_P == HEAD_DIM:
                keys = tl.load(k_ptrs)
                values = tl.load(v_ptrs)
            else:
                keys = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                values = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            values = tl.where(n_ok[:, None], values, 0.0)
        else:
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            pages = (block.to(tl.int64) * NUM_KV_HEADS + kv_head) * page_elems
            slot = offs_n % BLOCK_SIZE
            k_ptrs = kv_ptr + pages[None, :] + offs_d[:, None] * BLOCK_SIZE + slot[None, :]
            keys = tl.load(k_ptrs, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v_ptrs = kv_ptr + v_offset + pages[:, None] + slot[:, None] * HEAD_DIM
            values = tl.load(
                v_ptrs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
            )
        scores = tl.dot(q, keys, input_precision=PRECISION) * qk_scale
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows that have seen nothing yet keep m = -inf; subtracting 0 keeps them finite.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# num_reqs changes with every step: specialised (== 1, a multiple of 16), it would cost a
# compile at serving time for each new kind of value.
@triton.jit(do_not_specialize=["num_reqs"])
def varlen_kernel(
    out_ptr,
    q_ptr,
    kv_ptr,
    v_offset,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    num_reqs,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_table,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Request r's tiles start at query_start[r] // BLOCK_Q + r: increasing in r, and each
    # request has room for all of its tiles. Find the last request starting at or before.
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(found, mid, lo)
        hi = tl.where(found, hi, mid - 1)
    req = lo
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    local = tile - (q_start // BLOCK_Q + req)
    if local * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        token = local * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
        offs_d = tl.arange(0, HEAD_DIM_P)
        d_ok = offs_d < HEAD_DIM
        tok = (q_start + token).to(tl.int64)
        q_ptrs = q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
        q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = context + token
        # The tile's last query sees the history up to its own position.
        end = tl.minimum(seq_len, context + (local + 1) * BLOCK_Q)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = attend_tiles(
            acc,
            m_i,
            l_i,
            q,
            kv_ptr,
            v_offset,
            block_tables_ptr + req.to(tl.int64) * stride_table,
            kv_head,
            0,
            end,
            q_pos,
            qk_scale,
            NUM_KV_HEADS,
            HEAD_DIM,
            HEAD_DIM_P,
            BLOCK_SIZE,
            TILE_N,
            True,
            PRECISION,
        )
        release_dependents(PDL)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head
        tl.store(
            o_ptrs + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def decode_kernel(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    counters_ptr,
    qkv_ptr,
    cos_sin_ptr,
    positions_ptr,
    slot_mapping_ptr,
    kv_ptr,
    v_offset,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qkv_tok,
    stride_o_tok,
    stride_o_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # Splits of whole tiles; a request shorter than its splits leaves the last ones empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    # Rotary of the step's token: each dim d pairs with d +- HEAD_DIM / 2 (rotate()).
    half: tl.constexpr = HEAD_DIM // 2
    first_half = offs_d < half
    partner = tl.where(first_half, offs_d + half, offs_d - half)
    angle = tl.where(first_half, offs_d, offs_d - half)
    angles = cos_sin_ptr + tl.load(positions_ptr + req).to(tl.int64) * HEAD_DIM + angle
    cos = tl.load(angles, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(angles + half, mask=d_ok, other=0.0).to(tl.float32)
    signed_sin = tl.where(first_half, -sin, sin)
    dtype = kv_ptr.dtype.element_ty
    token = qkv_ptr + req.to(tl.int64) * stride_qkv_tok
    q_ptrs = token + head[:, None] * HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]  # the query heads' cells, loaded and stored
    q_own = tl.load(q_ptrs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    q_partner = tl.load(q_ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    q = rotate(q_own, q_partner, cos[None, :], signed_sin[None, :], dtype)
    # The split holding the last position writes the token's key and value into the
    # cache, and reads them back with the rest of its tiles once every warp has stored.
    slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
    if (slot >= 0) & (start < seq_len) & (seq_len <= start + per_split):
        k_ptrs = token + (NUM_HEADS + kv_head) * HEAD_DIM
        k_own = tl.load(k_ptrs + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        k_partner = tl.load(k_ptrs + partner, mask=d_ok, other=0.0).to(tl.float32)
        value = tl.load(k_ptrs + NUM_KV_HEADS * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        page = ((slot // BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * (HEAD_DIM * BLOCK_SIZE)
        offset = slot % BLOCK_SIZE
        key = rotate(k_own, k_partner, cos, signed_sin, dtype)
        tl.store(kv_ptr + page + offs_d * BLOCK_SIZE + offset, key, mask=d_ok)
        tl.store(kv_ptr + v_offset + page + offset * HEAD_DIM + offs_d, value, mask=d_ok)
        tl.debug_barrier()
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        kv_ptr,
        v_offset,
        block_tables_ptr + req.to(tl.int64) * stride_table,
        kv_head,
        start,
        end,
        rows,
        qk_scale,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEAD_DIM_P,
        BLOCK_SIZE,
        TILE_N,
        False,
        PRECISION,
    )
    release_dependents(PDL)
    # An empty range (padding rows of a graph, empty splits) yields zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + req.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head
        tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials [num_reqs, num_heads, NUM_SPLITS, HEAD_DIM_P] and stats [.., .., .., 2].
        num_heads = NUM_KV_HEADS * GROUP
        part = (req.to(tl.int64) * num_heads + head) * NUM_SPLITS
        tl.store(
            part_out_ptr + (part + split)[:, None] * HEAD_DIM_P + offs_d[None, :], out, mask=mask
        )
        tl.store(part_stats_ptr + (part + split) * 2, m_i, mask=row_ok)
        tl.store(part_stats_ptr + (part + split) * 2 + 1, l_i, mask=row_ok)
        # The split that finishes last merges them all (no second launch), then leaves the
        # counter at zero for the next call. acq_rel: the others' partials are visible.
        # The barrier: every warp's stores come before the one thread's release.
        counter = counters_ptr + req * NUM_KV_HEADS + kv_head
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            tl.store(counter, 0)
            merge_splits(
                out_ptr,
                part_out_ptr,
                part_stats_ptr,
                req,
                kv_head,
                stride_o_tok,
                stride_o_head,
                NUM_KV_HEADS,
                GROUP,
                HEAD_DIM,
                HEAD_DIM_P,
                NUM_SPLITS,
            )


@triton.jit
def merge_splits(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    req,
    kv_head,
    stride_o_tok,
    stride_o_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Each query head of the kv head from its splits' partials, weighted by their softmax
    statistics. A head's splits load as one tile, and the heads are unrolled: a handful of
    independent loads, not one round trip per split."""
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM  # the partials' padding columns were never written
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        part = (req.to(tl.int64) * NUM_KV_HEADS * GROUP + head) * NUM_SPLITS + splits
        m = tl.load(part_stats_ptr + part * 2)
        weight = tl.load(part_stats_ptr + part * 2 + 1)
        parts = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        )
        m_max = tl.max(m, 0)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        weight = weight * tl.exp2(m - m_ref)
        total = tl.sum(weight, 0)
        out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        o_ptrs = out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)
