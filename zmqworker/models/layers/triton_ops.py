"""Fused elementwise layers in Triton, for CUDA steps: each replaces a chain of eager
kernels with one (RMSNorm in the model dtype is eight of them, SiLU-and-multiply three).

They round as the plain-torch layers do (statistics in float32; every product rounded to
the model dtype where transformers rounds it), so both paths give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs
from zmqworker.triton_rms import rms_apply, rms_rstd


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_x_row,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < SIZE
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The residual stream is rounded to the model dtype after the add, as in torch.
        res = tl.load(residual_ptr + row * SIZE + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * SIZE + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = rms_rstd(tl.sum(x32 * x32, 0), eps, SIZE)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = rms_apply(x32, rstd, weight, dtype)
    tl.store(out_ptr + row * SIZE + offs, y.to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual), x + residual), or (norm(x), None) without a residual, for x
    [rows, size] (unit last stride); both new contiguous tensors."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"rms_norm needs x [rows, size] with a unit last stride, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    rows, size = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        residual_out = torch.empty_like(residual)
    if rows == 0:
        return out, residual_out
    _rms_norm_kernel[(rows,)](
        out,
        out if residual_out is None else residual_out,
        x,
        x if residual is None else residual,
        weight,
        eps,
        x.stride(0),
        SIZE=size,
        BLOCK=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
        **launch_options(x.device),
    )
    return out, residual_out


@triton.jit
def silu_times_up(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in dtype, of float32 gate and up projections, rounded as the torch
    layers round: each projection to dtype, then the activation, then the product. The
    SiLU kernel's and every gate/up GEMM's epilogue."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr, SIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < SIZE
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * SIZE + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * SIZE + SIZE + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * SIZE + offs, silu_times_up(gate, up, dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [rows, 2 * size] (contiguous)."""
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs a contiguous [rows, 2 * size], got {tuple(x.shape)}")
    rows, size = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, size, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
        out, x, SIZE=size, BLOCK=block, **launch_options(x.device)
    )
    return out
