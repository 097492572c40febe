"""The mixture of experts of a CUDA step in five Triton kernels, safe inside a CUDA graph:

1. route and 2. place (moe_sort.py; one kernel when the step's tokens fit one routing
   chunk): every token's top k experts, and the (token, choice) pairs sorted by expert,
   each expert's run padded to a multiple of BLOCK_M;
3. gate/up: one grouped GEMM over the blocks of the sorted pairs, each block one expert's
   weights, with SiLU-and-multiply in its epilogue (the [pairs, 2 * inter] product is
   never written);
4. down: the same over the activations, the routing weight multiplied in its epilogue;
5. combine: each token's products summed in choice order, in float32.

A step of one token (a lone request's decode) over small experts takes two kernels of
its own instead (one_token_experts.py).

The grids are fixed by the step's token count (the most blocks the padded runs can take),
and blocks past the last run return at once: no host synchronisation, no shape that
depends on the routing. Pairs routed to experts held on other ranks (expert parallelism)
are not placed, computed or summed here.

The tiles depend on the pairs each expert gets on average (tiles_for): decode steps give
an expert a few tokens (16-row blocks, long K tiles: the step is a read of the chosen
experts' weights), prefills hundreds (128-row blocks). Each tile set is a compile of its
own: token_starts gives the fewest tokens of each (and of its routing in chunks), which
warm-up runs.

Rounding is the plain-torch experts' (experts.py): each projection's output to the model
dtype, then the activation, the product, the weighted product; sums in float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from zmqworker.dot_precision import dot_precision
from zmqworker.models.layers import one_token_experts as one_token
from zmqworker.models.layers.moe_sort import (
    max_blocks,
    place_kernel,
    route_kernel,
    route_place_kernel,
)
from zmqworker.models.layers.triton_ops import silu_times_up
from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs
from zmqworker.triton_device import fit_stages, shared_memory


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # rows of a block of sorted pairs
    chunk: int  # tokens a routing program takes
    gate_up: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    down: tuple[int, int, int, int]
    # Blocks that take each column tile in turn: a block's pairs and an expert's weight
    # tile are read by programs that run together (L2), as in Triton's matmul tutorial.
    group_m: int = 1


# (the most pairs an expert gets on average, the tiles): the first that holds. The
# gate/up GEMM keeps two accumulators (gate and up), so its column tile is half the down's
# at the larger blocks.
_REGIMES: tuple[tuple[float, MoeTiles], ...] = (
    (16, MoeTiles(16, 16, (64, 128, 4, 4), (64, 128, 4, 4))),
    (64, MoeTiles(32, 32, (64, 128, 4, 4), (64, 128, 4, 4), group_m=4)),
    (256, MoeTiles(64, 64, (64, 64, 4, 4), (128, 64, 4, 4), group_m=8)),
    (float("inf"), MoeTiles(128, 128, (64, 64, 8, 3), (128, 64, 8, 3), group_m=8)),
)


def tiles_for(
    num_tokens: int,
    top_k: int,
    num_local: int,
    element_size: int = 2,
    shared_bytes: int | None = None,
) -> MoeTiles:
    """The step's tile set; 4-byte elements (float32 models) take half the K tile, so that
    the software pipeline's stages fit in shared memory. shared_bytes: the most a program
    may take on the device (shared_memory); fewer stages where the tiles' would not fit."""
    per_expert = num_tokens * top_k / num_local
    tiles = next(tiles for most, tiles in _REGIMES if per_expert <= most)
    if element_size > 2:
        gate_up, down = tiles.gate_up, tiles.down
        tiles = dataclasses.replace(
            tiles,
            gate_up=(gate_up[0], gate_up[1] // 2, *gate_up[2:]),
            down=(down[0], down[1] // 2, *down[2:]),
        )

    def fitted(gemm: tuple[int, int, int, int], weight_tiles: int) -> tuple[int, int, int, int]:
        # A stage holds the block's rows and the weight's tiles (gate/up has two).
        block_n, block_k, warps, stages = gemm
        stage = (tiles.block_m + weight_tiles * block_n) * block_k * element_size
        return block_n, block_k, warps, fit_stages(stages, stage, shared_bytes)

    return dataclasses.replace(tiles, gate_up=fitted(tiles.gate_up, 2), down=fitted(tiles.down, 1))


def token_starts(top_k: int, num_local: int) -> list[int]:
    """The fewest tokens of each tile set (one token: one_token_experts.py; the first set
    from two), and where a set that starts within one routing chunk first takes two: a
    step of each compiles what steps of its range run."""
    starts = [1, 2] + [int(most * num_local // top_k) + 1 for most, _ in _REGIMES[:-1]]
    ends = starts[2:] + [None]
    for start, end, (_, tiles) in zip(starts[1:], ends, _REGIMES, strict=True):
        if start <= tiles.chunk and (end is None or tiles.chunk + 1 < end):
            starts.append(tiles.chunk + 1)
    return sorted(starts)


@triton.jit
def _block_and_tile(num_blocks, num_tiles, GROUP_M: tl.constexpr):
    """This program's (block of sorted pairs, column tile): GROUP_M blocks take each
    column tile in turn."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_tiles
    first = pid // per_group * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks,
    inter,
    K,
    stride_x,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid_m, pid_n = _block_and_tile(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    x_rows = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * stride_x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    weights = w_ptr + expert.to(tl.int64) * 2 * inter * K
    gate_cols = weights + offs_n[None, :].to(tl.int64) * K
    up_cols = weights + (offs_n + inter)[None, :].to(tl.int64) * K
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(gate_cols + offs_k[:, None], mask=w_ok, other=0.0)
        w_up = tl.load(up_cols + offs_k[:, None], mask=w_ok, other=0.0)
        gate = tl.dot(x, w_gate, gate, input_precision=PRECISION)
        up = tl.dot(x, w_up, up, input_precision=PRECISION)
    release_dependents(PDL)
    out = out_ptr + pairs[:, None].to(tl.int64) * inter + offs_n[None, :]
    product = silu_times_up(gate, up, out_ptr.dtype.element_ty)
    tl.store(out, product, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(
    out_ptr,
    act_ptr,
    w_ptr,
    route_weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks,
    hidden,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid_m, pid_n = _block_and_tile(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    act_rows = act_ptr + pairs[:, None].to(tl.int64) * K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    cols = w_ptr + expert.to(tl.int64) * hidden * K + offs_n[None, :].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(act_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    release_dependents(PDL)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(route_weights_ptr + pairs, mask=m_ok, other=0.0)
    product = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * hidden + offs_n[None, :]
    tl.store(out, product.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(
    out_ptr,
    products_ptr,
    ids_ptr,
    num_tokens,
    hidden,
    first_expert,
    NUM_LOCAL: tl.constexpr,
    TOP_K: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (tokens < num_tokens)[:, None] & (offs < hidden)[None, :]
    acc = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pairs = tokens.to(tl.int64) * TOP_K + j
        expert = tl.load(ids_ptr + pairs, mask=tokens < num_tokens, other=-1) - first_expert
        held = (expert >= 0) & (expert < NUM_LOCAL)
        rows = products_ptr + pairs[:, None] * hidden + offs[None, :]
        acc += tl.load(rows, mask=ok & held[:, None], other=0.0).to(tl.float32)
    out = out_ptr + tokens[:, None].to(tl.int64) * hidden + offs[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    first_expert: int,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """For x [tokens, hidden] and its router logits [tokens, num_experts], each token's
    sum over its top_k experts held here (w13 [local, 2 * inter, hidden], w2 [local,
    hidden, inter], experts first_expert onwards) of weight * down(silu(gate) * up), as
    experts.route and experts.experts_reference give it; one token's over small experts in
    two kernels of its own (one_token_experts.py). tiles overrides the step's, and takes
    one token through the tile sets too (benchmarks, tests)."""
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    num_experts = logits.shape[1]
    if (
        x.stride(1) != 1
        or logits.shape[0] != num_tokens
        or not logits.is_contiguous()
        or w13.shape[2] != hidden
        or w2.shape != (num_local, hidden, inter)
        or not (w13.is_contiguous() and w2.is_contiguous())
        or not 1 <= top_k <= num_experts
    ):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, logits {tuple(logits.shape)}, w13 "
            f"{tuple(w13.shape)}, w2 {tuple(w2.shape)} (contiguous), top_k {top_k}"
        )
    if num_tokens == 1 and tiles is None and one_token.pays(hidden, inter):
        return one_token.one_token_experts(x, logits, w13, w2, top_k, renormalize, first_expert)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    t = tiles or tiles_for(
        num_tokens, top_k, num_local, x.element_size(), shared_memory(x.device.index or 0)
    )
    device, pdl = x.device, launch_options(x.device)
    num_pairs = num_tokens * top_k
    num_chunks = triton.cdiv(num_tokens, t.chunk)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    blocks = max_blocks(num_pairs, num_local, t.block_m)
    sorted_pairs = torch.empty(blocks * t.block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    # The routing kernels' constexprs: every kernel's, routing's, the two-kernel path's.
    common = dict(NUM_LOCAL=num_local, TOP_K=top_k, CHUNK=t.chunk)
    routing = dict(
        NUM_EXPERTS=num_experts, EXPERTS_P2=triton.next_power_of_2(num_experts),
        TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
    )  # fmt: skip
    if num_chunks == 1:
        route_place_kernel[(1,)](
            ids, weights, sorted_pairs, block_expert, logits, num_tokens, logits.stride(0),
            blocks, first_expert, **common, **routing, BLOCK_M=t.block_m, BLOCK_TILE=16, **pdl,
        )  # fmt: skip
    else:
        counts = torch.empty(num_chunks, num_local, dtype=torch.int32, device=device)
        route_kernel[(num_chunks,)](
            ids, weights, counts, logits, num_tokens, logits.stride(0), first_expert,
            **common, **routing, SUB=16, **pdl,
        )  # fmt: skip
        place_kernel[(num_chunks,)](
            sorted_pairs, block_expert, counts, ids, num_tokens, num_chunks, blocks,
            triton.cdiv(blocks, num_chunks), first_expert, **common, BLOCK_M=t.block_m,
            LOCAL_P2=triton.next_power_of_2(num_local), SUB_PAIRS=32, CHUNK_TILE=64,
            BLOCK_TILE=16, **pdl,
        )  # fmt: skip
    precision = dot_precision(x.dtype)
    activation = torch.empty(num_pairs, inter, dtype=x.dtype, device=device)
    block_n, block_k, warps, stages = t.gate_up
    _gate_up_kernel[(blocks * triton.cdiv(inter, block_n),)](
        activation, x, w13, sorted_pairs, block_expert, num_pairs, blocks, inter, hidden,
        x.stride(0), TOP_K=top_k, BLOCK_M=t.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=t.group_m, PRECISION=precision, num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    products = torch.empty(num_pairs, hidden, dtype=x.dtype, device=device)
    block_n, block_k, warps, stages = t.down
    _down_kernel[(blocks * triton.cdiv(hidden, block_n),)](
        products, activation, w2, weights, sorted_pairs, block_expert, num_pairs, blocks,
        hidden, inter, BLOCK_M=t.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=t.group_m, PRECISION=precision, num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    block = min(128, triton.next_power_of_2(hidden))
    _combine_kernel[(triton.cdiv(num_tokens, 8), triton.cdiv(hidden, block))](
        out, products, ids, num_tokens, hidden, first_expert, NUM_LOCAL=num_local,
        TOP_K=top_k, TOKENS=8, BLOCK=block, **pdl,
    )  # fmt: skip
    return out
