"""The mixture of experts of a one-token step (a lone request's decode) in two Triton
kernels, where fused_moe.py's path takes four (routing, gate/up, down, combine), each
waiting for the one before while the step is only a read of the token's k experts:

1. slices: one program per (choice, slice of the intermediate features). It routes the
   token as fused_moe's routing does (moe_sort.top_experts; over a one-row tile, whose
   softmax sum may round otherwise than route_place's by an ulp), and for its
   choice's expert, where held here, computes its slice of silu(gate) * up and that
   slice's share of the down projection: a float32 partial of the expert's output. The
   programs of slice 0 store their choice's expert and weight.
2. combine: each output feature, per choice the sum of its slices' partials (in slice
   order), rounded as fused_moe rounds an expert's product, the choices summed in choice
   order in float32.

So the down projection starts on each slice as soon as its gate/up is done, not when the
slowest gate/up program of the step is, and the routing costs no kernel of its own.
Rounding is fused_moe's (and experts.experts_reference's): each projection's output to
the model dtype, the activation, the product, the weighted product; the down
projection's sum only splits by slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.dot_precision import dot_precision
from zmqworker.models.layers.moe_sort import top_experts
from zmqworker.models.layers.triton_ops import silu_times_up
from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs
from zmqworker.triton_device import fit_stages, shared_memory

# Experts of at most this many weights a projection on a rank (tensor parallelism slices
# them) take these kernels: at one token a small expert's kernels are short, and the
# waits between fused_moe's four are much of the step (Qwen3-30B-A3B's 1.6M); a large
# expert's tile sets stream at the floor already (Mixtral-8x7B's 58.7M). docs/cuda.md
# has both.
SMALL_EXPERT = 1 << 23
# Intermediate features a program takes (Qwen3-30B-A3B's 768 in 12 slices: 96 programs
# for its 8 choices, each down row a whole 128-byte line), and (BLOCK_K of gate/up,
# BLOCK_N of down, warps, stages).
BLOCK_I = 64
TILES = (128, 128, 4, 4)
# The combine's output features a program, and the slices' partials it loads at a time.
COMBINE_BLOCK = 64
PART_TILE = 32
ROWS = 16  # the tensor cores' smallest tile: the token's row and 15 of zeros


@triton.jit
def _slices_kernel(
    partials_ptr,
    ids_ptr,
    weights_ptr,
    x_ptr,
    logits_ptr,
    w13_ptr,
    w2_ptr,
    first_expert,
    inter,
    hidden,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    NUM_LOCAL: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    j = tl.program_id(0)
    part = tl.program_id(1)
    experts = tl.arange(0, EXPERTS_P2)
    real = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + experts[None, :], mask=real[None, :], other=float("-inf"))
    logits = logits.to(tl.float32)
    chosen, weights, _ = top_experts(logits, EXPERTS_P2, TOP_K, TOP_K_P2, RENORMALIZE, 1)
    mine = tl.arange(0, TOP_K_P2)[None, :] == j
    expert = tl.sum(tl.where(mine, chosen, 0))
    if part == 0:
        tl.store(ids_ptr + j, expert)
        tl.store(weights_ptr + j, tl.sum(tl.where(mine, weights, 0.0)))
    local = expert - first_expert
    if (local >= 0) & (local < NUM_LOCAL):
        token = (tl.arange(0, ROWS) == 0)[:, None]  # the one real row of the tiles
        offs_i = part * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < inter
        w13 = w13_ptr + local.to(tl.int64) * 2 * inter * hidden
        gate_rows = w13 + offs_i[:, None].to(tl.int64) * hidden
        up_rows = w13 + (offs_i + inter)[:, None].to(tl.int64) * hidden
        gate = tl.zeros([ROWS, BLOCK_I], dtype=tl.float32)
        up = tl.zeros([ROWS, BLOCK_I], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            x = tl.load(x_ptr + offs_k[None, :] + 0 * token, mask=token & k_ok[None, :], other=0.0)
            w_ok = i_ok[:, None] & k_ok[None, :]
            w_gate = tl.load(gate_rows + offs_k[None, :], mask=w_ok, other=0.0)
            w_up = tl.load(up_rows + offs_k[None, :], mask=w_ok, other=0.0)
            gate = tl.dot(x, tl.trans(w_gate), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
        # Its padding rows and features are zeros.
        hidden_slice = silu_times_up(gate, up, x_ptr.dtype.element_ty)
        down_cols = w2_ptr + local.to(tl.int64) * hidden * inter + offs_i[None, :]
        partial = partials_ptr + (j * tl.num_programs(1) + part).to(tl.int64) * hidden
        for n0 in range(0, hidden, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hidden
            w = tl.load(down_cols + offs_n[:, None].to(tl.int64) * inter,
                        mask=n_ok[:, None] & i_ok[None, :], other=0.0)  # fmt: skip
            y = tl.dot(hidden_slice, tl.trans(w), input_precision=PRECISION)
            tl.store(partial + offs_n[None, :] + 0 * token, y, mask=token & n_ok[None, :])
    release_dependents(PDL)


@triton.jit
def _slices_combine_kernel(
    out_ptr,
    partials_ptr,
    ids_ptr,
    weights_ptr,
    hidden,
    first_expert,
    NUM_LOCAL: tl.constexpr,
    TOP_K: tl.constexpr,
    PARTS: tl.constexpr,
    PART_TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + j) - first_expert
        held = (local >= 0) & (local < NUM_LOCAL)  # else its partials were not written
        written = tl.where(held, PARTS, 0)
        y = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, PARTS, PART_TILE):  # in slice order, PART_TILE at a time
            parts = first + tl.arange(0, PART_TILE)
            rows = partials_ptr + (j * PARTS + parts)[:, None].to(tl.int64) * hidden
            tile = tl.load(rows + offs[None, :], mask=(parts < written)[:, None] & ok[None, :],
                           other=0.0)  # fmt: skip
            y += tl.sum(tile, 0)
        product = (y.to(dtype).to(tl.float32) * tl.load(weights_ptr + j)).to(dtype)
        acc = tl.where(held, acc + product.to(tl.float32), acc)
    tl.store(out_ptr + offs, acc.to(dtype), mask=ok)


def pays(hidden: int, inter: int) -> bool:
    """Whether one token's step takes these kernels for experts of this shape."""
    return hidden * inter <= SMALL_EXPERT


def one_token_experts(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    first_expert: int,
) -> torch.Tensor:
    """fused_moe of one token (x [1, hidden], logits [1, num_experts]; the shapes checked
    there)."""
    num_local, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_experts = logits.shape[1]
    device, pdl = x.device, launch_options(x.device)
    parts = triton.cdiv(inter, BLOCK_I)
    partials = torch.empty(top_k, parts, hidden, dtype=torch.float32, device=device)
    ids = torch.empty(top_k, dtype=torch.int32, device=device)
    weights = torch.empty(top_k, dtype=torch.float32, device=device)
    block_k, block_n, warps, stages = TILES
    size = x.element_size()
    if size > 2:  # float32: the stages' tiles fit in shared memory at half
        block_k, block_n = block_k // 2, block_n // 2
    # A stage holds the gate/up loop's rows and two weight tiles, or the down loop's tile.
    stage = max((ROWS + 2 * BLOCK_I) * block_k, block_n * BLOCK_I) * size
    stages = fit_stages(stages, stage, shared_memory(device.index or 0))
    _slices_kernel[(top_k, parts)](
        partials, ids, weights, x, logits, w13, w2, first_expert, inter, hidden,
        NUM_EXPERTS=num_experts, EXPERTS_P2=triton.next_power_of_2(num_experts),
        NUM_LOCAL=num_local, TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, BLOCK_I=BLOCK_I, BLOCK_K=block_k, BLOCK_N=block_n,
        ROWS=ROWS, PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
        **pdl,
    )  # fmt: skip
    out = torch.empty(1, hidden, dtype=x.dtype, device=device)
    _slices_combine_kernel[(triton.cdiv(hidden, COMBINE_BLOCK),)](
        out, partials, ids, weights, hidden, first_expert, NUM_LOCAL=num_local, TOP_K=top_k,
        PARTS=parts, PART_TILE=min(PART_TILE, triton.next_power_of_2(parts)),
        BLOCK=COMBINE_BLOCK, **pdl,
    )  # fmt: skip
    return out
