"""The decode kernels of paged attention (triton_attention.decode_attention launches them).

decode_kernel: one program per (request, kv head, split of the history). The split count
is a host-known constexpr (triton_metadata.decode_splits: a function of the batch size),
so a CUDA graph captured at a batch size holds for any history; each program reads its
request's sequence length and works out how many splits the history fills
(split_length): the others exit at once. So a long history at batch 1 spreads over as
many programs as a large batch does, and a short one keeps a few short splits.

Each working split rotates its query heads as it loads them (normalising each first where
the family has q and k norms); the one holding the last position also rotates the token's
key (normalised likewise) and writes it and the value into the cache first.
With one split it writes the output itself. Otherwise every working split writes its
partial result (float32, normalised) and softmax statistics, and merge_kernel, launched
next, merges them: one program per (request, query head, slice of the head dim), each
loading all of its partials at once. Merged by the last split in the same launch, a kv
head's query heads waited on each other, one round trip to memory each, behind a
counter's fence (docs/cuda.md).

Before its PDL wait, in a step that asks ahead (triton_metadata.asks_ahead, the launch's
PREFETCH), a program asks its split's first history pages into L2
(_prefetch_history), so that its first tiles come from there. Earlier steps wrote that
history; the sequence length and block-table entries read to find it only aim the hint.
"""

from __future__ import annotations

import triton
import triton.language as tl

from zmqworker.attention.triton_cache import rotate
from zmqworker.attention.triton_kernels import attend_tiles
from zmqworker.pdl import LINE_BYTES, prefetch_lines, release_dependents, wait_for_inputs
from zmqworker.triton_rms import rms_apply_pair


@triton.jit
def _split_length(
    seq_len,
    NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr,
    FEW: tl.constexpr,
    MIN_LONG: tl.constexpr,
):
    """triton_metadata.split_length, on the device."""
    even = tl.cdiv(seq_len, NUM_SPLITS)
    if NUM_SPLITS > FEW:
        even = tl.maximum(even, tl.minimum(tl.cdiv(seq_len, FEW), MIN_LONG))
    return tl.maximum(tl.cdiv(even, TILE_N), 1) * TILE_N


@triton.jit
def _working_splits(
    seq_len,
    NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr,
    FEW: tl.constexpr,
    MIN_LONG: tl.constexpr,
):
    """(positions per split, splits the history fills); a padding row (seq_len 0) has
    one working split, which writes zeros."""
    per_split = _split_length(seq_len, NUM_SPLITS, TILE_N, FEW, MIN_LONG)
    return per_split, tl.maximum(tl.cdiv(seq_len, per_split), 1)


@triton.jit
def decode_kernel(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    qkv_ptr,
    cos_sin_ptr,
    positions_ptr,
    slot_mapping_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
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
    FEW: tl.constexpr,
    MIN_LONG: tl.constexpr,
    PRECISION: tl.constexpr,
    QK_NORM: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_table
    if PREFETCH:
        _prefetch_history(kv_ptr, v_offset, table_ptr, stride_table, seq_lens_ptr + req,
                          kv_head, split, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE,
                          NUM_SPLITS, TILE_N, FEW, MIN_LONG)  # fmt: skip
    wait_for_inputs(PDL)
    seq_len = tl.load(seq_lens_ptr + req)
    per_split, active = _working_splits(seq_len, NUM_SPLITS, TILE_N, FEW, MIN_LONG)
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
        if QK_NORM:
            q_own, q_partner = rms_apply_pair(
                q_own, q_partner, tl.sum(q_own * q_own, 1)[:, None], q_norm_ptr,
                offs_d[None, :], partner[None, :], d_ok[None, :], eps, HEAD_DIM, dtype,
            )  # fmt: skip
        q = rotate(q_own, q_partner, cos[None, :], signed_sin[None, :], dtype)
        # The split holding the last position writes the token's key and value into the
        # cache, and reads them back with the rest of its tiles once every warp has stored.
        slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
        if (slot >= 0) & (split == active - 1):
            k_ptrs = token + (NUM_HEADS + kv_head) * HEAD_DIM
            k_own = tl.load(k_ptrs + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            k_partner = tl.load(k_ptrs + partner, mask=d_ok, other=0.0).to(tl.float32)
            if QK_NORM:
                k_own, k_partner = rms_apply_pair(
                    k_own, k_partner, tl.sum(k_own * k_own, 0), k_norm_ptr, offs_d, partner,
                    d_ok, eps, HEAD_DIM, dtype,
                )  # fmt: skip
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
            table_ptr,
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


# The pages of a split asked ahead: a short history's split holds one to four.
PREFETCH_PAGES = tl.constexpr(4)


@triton.jit
def _prefetch_history(kv_ptr, v_offset, table_ptr, table_width, seq_len_ptr, kv_head, split,
                      NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr, FEW: tl.constexpr,
                      MIN_LONG: tl.constexpr):  # fmt: skip
    """Before the PDL wait: the keys and values of the first PREFETCH_PAGES pages of this
    program's split asked into L2 while the kernel ahead still ends. The sequence length
    and block table are the step's inputs, written before its first kernel, and read here
    only to aim the hint: a value not yet current would ask other lines, never change a
    result. Pages within the table's row, block ids within the cache: every line asked
    is the cache's."""
    per_line: tl.constexpr = LINE_BYTES * 8 // kv_ptr.dtype.element_ty.primitive_bitwidth
    page_elems: tl.constexpr = HEAD_DIM * BLOCK_SIZE
    if HEAD_DIM_P * BLOCK_SIZE >= per_line:  # pages of a line or more (asks_ahead: a power of 2)
        seq_len = tl.load(seq_len_ptr)
        per_split, active = _working_splits(seq_len, NUM_SPLITS, TILE_N, FEW, MIN_LONG)
        if split < active:  # the idle splits of a short history ask nothing
            start = split * per_split
            end = tl.minimum(seq_len, start + per_split)
            pages = start // BLOCK_SIZE + tl.arange(0, PREFETCH_PAGES)
            page_ok = (pages * BLOCK_SIZE < end) & (pages < table_width)
            blocks = tl.load(table_ptr + pages, mask=page_ok, other=0)
            num_blocks = v_offset // (NUM_KV_HEADS * page_elems)
            blocks = tl.minimum(tl.maximum(blocks, 0), num_blocks - 1).to(tl.int64)
            lines = tl.arange(0, HEAD_DIM_P * BLOCK_SIZE // per_line) * per_line
            page = (blocks * NUM_KV_HEADS + kv_head)[:, None] * page_elems
            ok = page_ok[:, None] & (lines < page_elems)[None, :]
            prefetch_lines(kv_ptr + page + lines[None, :], ok, kv_ptr)
            prefetch_lines(kv_ptr + v_offset + page + lines[None, :], ok, kv_ptr)


@triton.jit
def merge_kernel(
    out_ptr,
    part_out_ptr,
    part_stats_ptr,
    seq_lens_ptr,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    CHUNK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FEW: tl.constexpr,
    MIN_LONG: tl.constexpr,
    PDL: tl.constexpr,
):
    """Dims [chunk * CHUNK_D, + CHUNK_D) of one query head of one request, from the
    partials of its history's working splits weighted by their softmax statistics."""
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    _, active = _working_splits(tl.load(seq_lens_ptr + req), NUM_SPLITS, TILE_N, FEW, MIN_LONG)
    idx = tl.arange(0, NUM_SPLITS)
    ok = idx < active
    offs_d = chunk * CHUNK_D + tl.arange(0, CHUNK_D)
    d_ok = offs_d < HEAD_DIM  # the partials' padding columns were never written
    part = (req.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + idx
    m = tl.load(part_stats_ptr + part * 2, mask=ok, other=float("-inf"))
    weight = tl.load(part_stats_ptr + part * 2 + 1, mask=ok, other=0.0)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
        mask=ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    release_dependents(PDL)  # its loads are its main loop
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padding row's one split
    weight = weight * tl.exp2(m - m_ref)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)
