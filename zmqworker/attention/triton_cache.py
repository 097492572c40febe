"""Rotary embedding and the KV cache write in one Triton kernel, for CUDA steps.

One program per token: it rotates the token's query heads in place (in the fused qkv
projection's output) and writes its rotated keys and its values straight into the paged
cache through the slot mapping (kv_cache.py's layout), so the rotated keys never exist as
a tensor of their own. Where the family normalises each query and key head before
rotary (Qwen3's q and k norms: head_norms.py), the kernel does that too, so the norms take no
launch of their own (the decode kernel does the same). Rounding follows transformers'
bf16/fp16 maths (each product is rounded to the model dtype before the sum), up to the
compiler fusing a product and a sum into one FMA (one rounding fewer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.attention.head_norms import HeadNorms, norm_args
from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs
from zmqworker.triton_rms import rms_apply_pair


@triton.jit
def rotate(x, partner, cos, signed_sin, OUT_DTYPE: tl.constexpr):
    """x * cos + partner * signed_sin, each product rounded to OUT_DTYPE first: the first
    half of a head takes its partner in the second half and -sin, the second half its
    partner in the first and +sin (negation is exact, so both halves round as torch's
    x1 * cos - x2 * sin and x2 * cos + x1 * sin)."""
    a = (x * cos).to(OUT_DTYPE).to(tl.float32)
    b = (partner * signed_sin).to(OUT_DTYPE).to(tl.float32)
    return (a + b).to(OUT_DTYPE)


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr,
    cos_sin_ptr,
    positions_ptr,
    slot_mapping_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    v_offset,
    stride_tok,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    tok = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_P)
    d_ok = offs < half
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs, mask=d_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + tok * stride_tok

    heads = tl.arange(0, HEADS_P)
    q_mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    q_ptrs = row + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptrs + half, mask=q_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q_sum_sq = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))[:, None]
        x1, x2 = rms_apply_pair(
            x1, x2, q_sum_sq, q_norm_ptr, offs[None, :], half + offs[None, :], d_ok[None, :],
            eps, HEAD_DIM, dtype,
        )  # fmt: skip
    o1 = rotate(x1, x2, cos[None, :], -sin[None, :], dtype)
    o2 = rotate(x2, x1, cos[None, :], sin[None, :], dtype)
    tl.store(q_ptrs, o1, mask=q_mask)
    tl.store(q_ptrs + half, o2, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_P)
        k_mask = (kv_heads < NUM_KV_HEADS)[:, None] & d_ok[None, :]
        k_ptrs = row + (NUM_HEADS + kv_heads)[:, None] * HEAD_DIM + offs[None, :]
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptrs + half, mask=k_mask, other=0.0).to(tl.float32)
        if QK_NORM:
            k_sum_sq = (tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1))[:, None]
            k1, k2 = rms_apply_pair(
                k1, k2, k_sum_sq, k_norm_ptr, offs[None, :], half + offs[None, :],
                d_ok[None, :], eps, HEAD_DIM, dtype,
            )  # fmt: skip
        r1 = rotate(k1, k2, cos[None, :], -sin[None, :], dtype)
        r2 = rotate(k2, k1, cos[None, :], sin[None, :], dtype)
        v_ptrs = k_ptrs + NUM_KV_HEADS * HEAD_DIM
        v1 = tl.load(v_ptrs, mask=k_mask, other=0.0)
        v2 = tl.load(v_ptrs + half, mask=k_mask, other=0.0)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        page = ((block * NUM_KV_HEADS + kv_heads) * (HEAD_DIM * BLOCK_SIZE))[:, None]
        # Keys transposed within a page (dim d at row d), values as rows.
        key_at = kv_ptr + page + offs[None, :] * BLOCK_SIZE + offset
        tl.store(key_at, r1, mask=k_mask)
        tl.store(key_at + half * BLOCK_SIZE, r2, mask=k_mask)
        value_at = kv_ptr + v_offset + page + offset * HEAD_DIM + offs[None, :]
        tl.store(value_at, v1, mask=k_mask)
        tl.store(value_at + half, v2, mask=k_mask)


def rope_and_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    norms: HeadNorms | None = None,
) -> None:
    """qkv [num_tokens, num_heads + 2 * num_kv_heads, head_dim] (unit strides but the
    first): rotate its queries in place, store its rotated keys and its values at
    slot_mapping's slots (negative slots are skipped). cos_sin [positions, head_dim] holds
    cos then sin of each position. norms: each query and key head is normalised first
    (the normalised, rotated queries stay in qkv)."""
    num_tokens, _, head_dim = qkv.shape
    if num_tokens == 0:
        return
    if qkv.stride(2) != 1 or qkv.stride(1) != head_dim:
        raise ValueError(f"qkv must have unit head strides, got strides {qkv.stride()}")
    block_size = kv_cache.shape[3] // head_dim
    _rope_and_cache_kernel[(num_tokens,)](
        qkv,
        cos_sin,
        positions,
        slot_mapping,
        kv_cache,
        *norm_args(norms, head_dim, qkv.dtype, cos_sin),
        kv_cache[0].numel(),
        qkv.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=triton.next_power_of_2(num_heads),
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF_P=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=block_size,
        QK_NORM=norms is not None,
        **launch_options(qkv.device),
    )
