"""The Triton kernels of paged attention (triton_attention.py launches them): the online
softmax over a range of history tiles that both kernels run, and the varlen kernel of
any step (the decode kernel is in triton_decode.py). Every kernel reads the cache in its
own layout (kv_cache.py) through the block table."""

from __future__ import annotations

import triton
import triton.language as tl

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
