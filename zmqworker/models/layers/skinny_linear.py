"""A linear layer of a decode-sized step, split along K: one Triton kernel where cuBLAS runs
a split-K GEMM and then a second kernel that sums its splits. Layers take it where it
measured faster than cuBLAS, up to the rows it was measured faster at (row_limit;
linear.SkinnyPath).

At decode-sized steps a projection is a read of its weight, and a decode step has a few
of them per layer (q/k/v, o, down) of a few MB to a hundred MB each. To keep every
multiprocessor streaming, the K dimension is split over SPLIT_K programs per BLOCK_N
output features; each writes its float32 partial sums, and the program of a feature tile
that finishes last (an atomic counter per tile tells it) adds them in split order, adds
the bias and writes the output. One launch, not two, and the same bits on every run.

The counters are a persistent int32 buffer of the layer (counter_slots), zero at rest:
the last program sets its tile's back to zero, so CUDA graphs replay over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.dot_precision import dot_precision
from zmqworker.models.layers import row_tiles
from zmqworker.pdl import (
    launch_options,
    prefetch_weights,
    release_dependents,
    wait_for_inputs,
)

# The most rows the kernel takes (its largest row tile, row_tiles.py), and the most a
# layer sends it unless its weight is small (row_limit).
MAX_ROWS = row_tiles.MAX_ROWS
LARGE_WEIGHT_ROWS = 16
MIN_BLOCK_N = 16
# About three four-warp programs per multiprocessor of an H200, in warps.
MAX_WARPS = 384 * 4
# Weights of fewer elements are launch-bound, and the kernel's one launch pays.
SMALL_WEIGHT = 1 << 22
# Small weights take the kernel as far as it beat cuBLAS (docs/cuda.md).
SMALL_WEIGHT_ROWS = 32


# num_rows changes with every step: specialised, each new kind would cost a compile.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    out_ptr,
    part_ptr,
    counters_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    num_rows,
    N,
    K,
    per_split,
    stride_x,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # per_split: whole BLOCK_K steps; the last split takes what is left, none is empty.
    k_start = split * per_split
    k_end = tl.minimum(K, k_start + per_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    prefetch_weights(w_rows, n_ok, k_start, k_end, BLOCK_K, PDL)
    wait_for_inputs(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_rows
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    release_dependents(PDL)
    mask = m_ok[:, None] & n_ok[None, :]
    cells = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K > 1:
        # Partials [SPLIT_K, num_rows, N]; the tile's last split sums them in split order.
        tl.store(part_ptr + split * num_rows * N + cells, acc, mask=mask)
        tl.debug_barrier()  # every warp's partials come before the one thread's release
        counter = counters_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.store(counter, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + s * num_rows * N + cells, mask=mask, other=0.0)
            _finish(out_ptr, bias_ptr, acc, cells, offs_n, n_ok, mask, HAS_BIAS)
    else:
        _finish(out_ptr, bias_ptr, acc, cells, offs_n, n_ok, mask, HAS_BIAS)


@triton.jit
def _finish(out_ptr, bias_ptr, acc, cells, offs_n, n_ok, mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + cells, acc.to(out_ptr.dtype.element_ty), mask=mask)


def pays(out_features: int, in_features: int) -> bool:
    """Whether the kernel beat cuBLAS for a weight of this shape (docs/cuda.md): where K is
    at least N (o, down), for small weights, and for large wide ones at least 1.5x as wide
    as deep over a K of 2,048 or more (the q/k/v of Llama-3-8B, Llama-3.2-1B and
    Qwen3-30B-A3B). Other wide ones stay on cuBLAS: Qwen2.5-7B's q/k/v (1.29x) lost, and
    narrower K (a row-parallel layer cut by a large TP) was not measured."""
    n, k = out_features, in_features
    return k >= n or n * k < SMALL_WEIGHT or (2 * n >= 3 * k and k >= 2048)


def row_limit(out_features: int, in_features: int) -> int:
    """The most rows a layer of this shape sends the kernel (0: none). Small weights are
    launch-bound at every decode size: up to SMALL_WEIGHT_ROWS, a small model's chain of
    kernels stays in Triton, where each launches before the one ahead of it ends
    (pdl.py); cuBLAS cannot. Large ones, measured up to 16 rows, stop there."""
    if not pays(out_features, in_features):
        return 0
    if out_features * in_features < SMALL_WEIGHT:
        return SMALL_WEIGHT_ROWS
    return LARGE_WEIGHT_ROWS


def counter_slots(out_features: int) -> int:
    """The counters a layer of this many output features needs (its smallest tiles')."""
    return triton.cdiv(out_features, MIN_BLOCK_N)


def k_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, BLOCK_K steps per split) that run for SPLIT_K asked over k inputs: as many
    as the K steps fill, none left empty."""
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, max(1, min(split_k, steps)))
    return triton.cdiv(steps, per_split), per_split


def _tiles(n: int, k: int, rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for a weight [n, k] at a step of
    this many rows: narrow tiles for narrow layers, and the most splits (up to 8) that
    keep the launch within MAX_WARPS: at one row (and so up to 16, one row tile) the best
    setting of a sweep, or near it, for every layer measured. From 32 rows (small weights
    only, row_limit) a K of at most 1024 goes unsplit over twice the programs, which was
    faster there (docs/cuda.md; bench/results/skinny_linear_sweep.json,
    skinny_linear_rows.json, skinny_tiles_h100.json and skinny_wide_h100.json)."""
    if rows > LARGE_WEIGHT_ROWS and k <= 1024:
        return 16, 128, 1, 4, 3
    block_n, warps = 32 if n <= 1024 else 64, 4
    if 1024 < n <= 1536 and rows <= LARGE_WEIGHT_ROWS:
        block_n, warps = 16, 2  # best there: Qwen2.5-1.5B's o and down (H100)
    elif n > k and n * k >= SMALL_WEIGHT:
        block_n = 32  # large wide layers (pays): twice the tiles, half the splits
    split_k = 8
    while split_k > 1 and triton.cdiv(n, block_n) * split_k * warps > MAX_WARPS:
        split_k //= 2
    return block_n, 128, split_k, warps, 3


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x W^T + b for x [m <= MAX_ROWS, k] and a contiguous weight [n, k]: [m, n], through
    the kernel compiled for m's row tile.
    counters: int32 zeros of at least counter_slots(n), left zero. tiles overrides the
    shape's (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) (benchmarks)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] > MAX_ROWS:
        raise ValueError(
            f"skinny_linear needs x [<= {MAX_ROWS}, k] with a unit last stride, got x "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    rows, k = x.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous [n, {k}]")
    for name, t, shape in (("weight", weight, None), ("bias", bias, (n,))):
        if t is None:
            continue
        if t.dtype != x.dtype or t.device != x.device or shape not in (None, tuple(t.shape)):
            raise ValueError(
                f"{name} {tuple(t.shape)} {t.dtype} on {t.device} must be "
                f"{'[' + str(n) + '] ' if shape else ''}{x.dtype} on {x.device}, as x is"
            )
    if counters.dtype != torch.int32 or counters.numel() < counter_slots(n):
        raise ValueError(
            f"skinny_linear of {n} outputs needs at least {counter_slots(n)} int32 counters, "
            f"got {counters.numel()} {counters.dtype}"
        )
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n, block_k, split_k, warps, stages = tiles or _tiles(n, k, rows)
    if block_n < MIN_BLOCK_N:
        raise ValueError(f"BLOCK_N {block_n} is below the counters' tile {MIN_BLOCK_N}")
    split_k, steps_per_split = k_splits(k, block_k, split_k)
    parts = out  # unused with one split
    if split_k > 1:
        parts = torch.empty(split_k * rows * n, dtype=torch.float32, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, block_n), split_k)](
        out,
        parts,
        counters,
        x,
        weight,
        weight if bias is None else bias,
        rows,
        n,
        k,
        steps_per_split * block_k,
        x.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=row_tiles.row_tile(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=warps,
        num_stages=stages,
        **launch_options(x.device),
    )
    return out
