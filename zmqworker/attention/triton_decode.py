"""The decode kernel of paged attention (triton_attention.decode_attention launches it).

One program per (request, kv head, split of the history). The split count is a
host-known constexpr (triton_metadata.decode_splits: a function of the batch size), so a
CUDA graph captured at a batch size holds for any history; each program reads its
request's sequence length and works out how many splits the history fills
(split_length): the others exit at once. So a long history at batch 1 spreads over as
many programs as a large batch does, and a short one keeps a few short splits.

Each working split rotates its query heads as it loads them; the one holding the last
position also rotates the token's key and writes it and the value into the cache first.
With one split it writes the output itself. Otherwise every working split writes its
partial result (float32, normalised) and softmax statistics, and the split that finishes
last (an atomic counter per (request, kv head)) merges them in the same launch. Past
MERGE_FAN_IN working splits the merge has two levels: the last split of each group of
MERGE_FAN_IN merges its group into the group's first slot, and the last group merges the
groups, so no program loads more than MERGE_FAN_IN partials per head. Every counter is
left at zero for the next launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from zmqworker.attention.triton_cache import rotate
from zmqworker.attention.triton_kernels import attend_tiles
from zmqworker.pdl import release_dependents, wait_for_inputs


@triton.jit
def _split_length(
    seq_len,
    NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr,
    FAN_IN: tl.constexpr,
    MIN_LONG: tl.constexpr,
):
    """triton_metadata.split_length, on the device."""
    even = tl.cdiv(seq_len, NUM_SPLITS)
    if NUM_SPLITS > FAN_IN:
        even = tl.maximum(even, tl.minimum(tl.cdiv(seq_len, FAN_IN), MIN_LONG))
    return tl.maximum(tl.cdiv(even, TILE_N), 1) * TILE_N


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
    FAN_IN: tl.constexpr,
    MIN_LONG: tl.constexpr,
    MERGE_WIDTH: tl.constexpr,
    COUNTER_STRIDE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    per_split = _split_length(seq_len, NUM_SPLITS, TILE_N, FAN_IN, MIN_LONG)
    # A padding row (seq_len 0) has one working split, which writes zeros.
    active = tl.maximum(tl.cdiv(seq_len, per_split), 1)
    if split < active:
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
        if (slot >= 0) & (split == active - 1):
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
        # An empty range (padding rows of a graph) yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            o_ptrs = out_ptr + req.to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head
            tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Partials [num_reqs, num_heads, NUM_SPLITS, HEAD_DIM_P], stats [.., .., .., 2].
            part = (req.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], out, mask=mask)
            tl.store(part_stats_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=row_ok)
            _merge_when_last(
                out_ptr,
                part_out_ptr,
                part_stats_ptr,
                counters_ptr,
                req,
                kv_head,
                split,
                active,
                stride_o_tok,
                stride_o_head,
                NUM_HEADS,
                NUM_KV_HEADS,
                GROUP,
                HEAD_DIM,
                HEAD_DIM_P,
                NUM_SPLITS,
                FAN_IN,
                MERGE_WIDTH,
                COUNTER_STRIDE,
            )


@triton.jit
def _merge_when_last(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    counters_ptr,
    req,
    kv_head,
    split,
    active,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FAN_IN: tl.constexpr,
    MERGE_WIDTH: tl.constexpr,
    COUNTER_STRIDE: tl.constexpr,
):
    """After a split stored its partial: the last of the working splits merges them all
    (one level), or the last of its group merges the group and the last group the groups.
    acq_rel: the others' partials are visible to the merger; the barriers: every warp's
    stores come before the one thread's release."""
    # Counters of a (request, kv head): [the whole, then one per group when grouped].
    whole = counters_ptr + (req * NUM_KV_HEADS + kv_head) * COUNTER_STRIDE
    tl.debug_barrier()
    # Tested on the constexpr first: a launch of at most FAN_IN splits has no second level.
    if NUM_SPLITS <= FAN_IN:
        _merge_all(
            out_ptr,
            part_out_ptr,
            part_stats_ptr,
            whole,
            req,
            kv_head,
            active,
            stride_o_tok,
            stride_o_head,
            NUM_HEADS,
            GROUP,
            HEAD_DIM,
            HEAD_DIM_P,
            NUM_SPLITS,
            MERGE_WIDTH,
        )
    elif active <= FAN_IN:
        _merge_all(
            out_ptr,
            part_out_ptr,
            part_stats_ptr,
            whole,
            req,
            kv_head,
            active,
            stride_o_tok,
            stride_o_head,
            NUM_HEADS,
            GROUP,
            HEAD_DIM,
            HEAD_DIM_P,
            NUM_SPLITS,
            MERGE_WIDTH,
        )
    else:
        group = split // FAN_IN
        first = group * FAN_IN
        members = tl.minimum(active - first, FAN_IN)
        mine = whole + 1 + group
        if tl.atomic_add(mine, 1, sem="acq_rel") == members - 1:
            tl.store(mine, 0)
            _merge(
                out_ptr,
                part_out_ptr,
                part_stats_ptr,
                req,
                kv_head,
                first,
                1,
                members,
                stride_o_tok,
                stride_o_head,
                NUM_HEADS,
                GROUP,
                HEAD_DIM,
                HEAD_DIM_P,
                NUM_SPLITS,
                MERGE_WIDTH,
                False,
            )
            tl.debug_barrier()
            groups = tl.cdiv(active, FAN_IN)
            if tl.atomic_add(whole, 1, sem="acq_rel") == groups - 1:
                tl.store(whole, 0)
                _merge(
                    out_ptr,
                    part_out_ptr,
                    part_stats_ptr,
                    req,
                    kv_head,
                    0,
                    FAN_IN,
                    groups,
                    stride_o_tok,
                    stride_o_head,
                    NUM_HEADS,
                    GROUP,
                    HEAD_DIM,
                    HEAD_DIM_P,
                    NUM_SPLITS,
                    MERGE_WIDTH,
                    True,
                )


@triton.jit
def _merge_all(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    whole,
    req,
    kv_head,
    active,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_WIDTH: tl.constexpr,
):
    """One level: the last of the working splits merges them into the output."""
    if tl.atomic_add(whole, 1, sem="acq_rel") == active - 1:
        tl.store(whole, 0)
        _merge(
            out_ptr,
            part_out_ptr,
            part_stats_ptr,
            req,
            kv_head,
            0,
            1,
            active,
            stride_o_tok,
            stride_o_head,
            NUM_HEADS,
            GROUP,
            HEAD_DIM,
            HEAD_DIM_P,
            NUM_SPLITS,
            MERGE_WIDTH,
            True,
        )


@triton.jit
def _merge(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    req,
    kv_head,
    first,
    step,
    count,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_WIDTH: tl.constexpr,
    TO_OUT: tl.constexpr,
):
    """Each query head of the kv head from `count` partials at slots first, first + step,
    ..., weighted by their softmax statistics: into the output (TO_OUT), or as one
    partial with its statistics into slot `first`. A head's partials load as one tile,
    and the heads are unrolled: a handful of independent loads, not one round trip per
    partial."""
    idx = tl.arange(0, MERGE_WIDTH)
    ok = idx < count
    slots = first + idx * step
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM  # the partials' padding columns were never written
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        row = (req.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
        part = row + slots
        m = tl.load(part_stats_ptr + part * 2, mask=ok, other=float("-inf"))
        weight = tl.load(part_stats_ptr + part * 2 + 1, mask=ok, other=0.0)
        parts = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_max = tl.max(m, 0)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        weight = weight * tl.exp2(m - m_ref)
        total = tl.sum(weight, 0)
        out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        if TO_OUT:
            o_ptrs = out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)
        else:
            dst = row + first
            tl.store(part_out_ptr + dst * HEAD_DIM_P + offs_d, out, mask=d_ok)
            tl.store(part_stats_ptr + dst * 2, m_max)
            tl.store(part_stats_ptr + dst * 2 + 1, total)
