"""The MLP's gate/up projection of a decode-sized step with SiLU-and-multiply in its
epilogue: one Triton kernel where the eager step runs cuBLAS and the SiLU kernel.

At up to 64 rows the projection is a read of its weight. Each program owns BLOCK_N
features of the activation for every row: it streams the gate rows and the up rows of
those features once, and writes silu(gate) * up, never the [rows, 2 * size] product:
closer to the weight-read floor than cuBLAS and the SiLU kernel at every row tile
(docs/cuda.md, bench/results/skinny_gate_up.json).

The epilogue rounds as the eager layers do (the projection's outputs to the model dtype,
then the activation, then the product), so the bits differ from the eager step's only by
the product's summation order. No prologue (the RMSNorm before the projection): work on
the input between its load and the product stalls Triton's software pipeline, and it
measured slower than cuBLAS after the norm kernel (docs/cuda.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.dot_precision import dot_precision
from zmqworker.models.layers import row_tiles
from zmqworker.models.layers.triton_ops import silu_times_up
from zmqworker.pdl import (
    launch_options,
    prefetch_weights,
    release_dependents,
    wait_for_inputs,
)
from zmqworker.triton_device import fit_stages, multiprocessors, shared_memory

# Steps above the last row tile go to cuBLAS and the SiLU kernel.
MAX_ROWS = row_tiles.MAX_ROWS
# Weights (size * K elements) at or above LARGE_WEIGHT take wide tiles up to 16 rows;
# below SMALL_WEIGHT, narrow ones from 32 rows (_tiles).
LARGE_WEIGHT = 1 << 24
SMALL_WEIGHT = 1 << 22
# A K this short streams a program's tile quickly, so a ragged last wave shows (_tiles).
SHORT_K = 2048
# The width of the tiles from 32 rows; past one such program a multiprocessor, a second
# wave (_tiles). The rule was measured on the 132 of an H100 SXM, the count taken where
# the device's is unknown.
WIDE_N = 64
MULTIPROCESSORS = 132


# num_rows changes with every step: specialised, each new kind would cost a compile.
@triton.jit(do_not_specialize=["num_rows"])
def _gate_up_silu_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    num_rows,
    size,
    K,
    stride_x,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    gate_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    up_rows = w_ptr + (offs_n + size)[:, None].to(tl.int64) * K
    prefetch_weights(gate_rows, n_ok, 0, K, BLOCK_K, PDL)
    prefetch_weights(up_rows, n_ok, 0, K, BLOCK_K, PDL)
    wait_for_inputs(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_rows
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_rows + offs_k[None, :], mask=w_ok, other=0.0)
        w_up = tl.load(up_rows + offs_k[None, :], mask=w_ok, other=0.0)
        gate = tl.dot(x, tl.trans(w_gate), gate, input_precision=PRECISION)
        up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
    release_dependents(PDL)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + size + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * size + offs_n[None, :]
    product = silu_times_up(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptrs, product, mask=m_ok[:, None] & n_ok[None, :])


def _tiles(
    block_m: int,
    size: int,
    k: int,
    element_size: int = 2,
    shared_bytes: int | None = None,
    sms: int | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [2 * size, k] weight at a row tile:
    the best of sweeps (bench/skinny_gate_up.py --sweep; docs/cuda.md), with fewer stages
    or a narrower K tile where the pipeline's would not fit in shared_bytes (shared_memory).

    Up to 16 rows: 64-wide tiles for large weights. From 32 rows: four stages of 128-wide
    K, which fill a Hopper multiprocessor's shared memory at 64 wide; where a short K
    leaves more 64-wide programs than the device has multiprocessors (`sms`; None:
    MULTIPROCESSORS), half the K tile lets two share one, not a ragged second wave
    (Qwen2.5-1.5B's and Qwen2.5-3B's shapes). Small weights take 16-wide tiles: more
    programs for their few bytes."""
    if block_m < 32:
        block_n, block_k, stages = (64 if size * k >= LARGE_WEIGHT else 32), 128, 3
    elif size * k < SMALL_WEIGHT:
        block_n, block_k, stages = 16, 128, 4
    elif k <= SHORT_K and triton.cdiv(size, WIDE_N) > (sms or MULTIPROCESSORS):
        block_n, block_k, stages = WIDE_N, 64, 4
    else:
        block_n, block_k, stages = WIDE_N, 128, 4

    def stage_bytes() -> int:  # the rows' and the two weight tiles' buffers
        return (block_m + 2 * block_n) * block_k * element_size

    stages = fit_stages(stages, stage_bytes(), shared_bytes)
    while shared_bytes is not None and block_k > 32 and stages * stage_bytes() > shared_bytes:
        block_k //= 2
    return block_n, block_k, 4, stages


def gate_up_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = x W^T + b, for x [m <= MAX_ROWS, k] and weight
    [2 * size, k] (gate rows, then up rows): [m, size]. tiles overrides the shape's
    (BLOCK_N, BLOCK_K, num_warps, num_stages) (benchmarks)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[0] > MAX_ROWS or weight.shape[0] % 2:
        raise ValueError(
            f"gate_up_silu needs x [<= {MAX_ROWS}, k] with a unit last stride and an even "
            f"number of weight rows, got x {tuple(x.shape)} strides {x.stride()}, weight "
            f"{tuple(weight.shape)}"
        )
    rows, k = x.shape
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous [2 * size, {k}]")
    size = weight.shape[0] // 2
    out = torch.empty(rows, size, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = row_tiles.row_tile(rows)
    device = x.device.index or 0
    block_n, block_k, warps, stages = tiles or _tiles(
        block_m, size, k, x.element_size(), shared_memory(device), multiprocessors(device)
    )
    _gate_up_silu_kernel[(triton.cdiv(size, block_n),)](
        out,
        x,
        weight,
        weight if bias is None else bias,
        rows,
        size,
        k,
        x.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=warps,
        num_stages=stages,
        **launch_options(x.device),
    )
    return out
