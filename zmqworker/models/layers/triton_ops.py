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


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    second_weight_ptr,
    eps,
    stride_x_row,
    stride_x_sub,
    stride_out_row,
    stride_out_sub,
    NUM_SUB: tl.constexpr,
    SECOND_FROM: tl.constexpr,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    # A row is (token, sub-row): sub-rows are heads for q/k norm, one per token otherwise.
    pid = tl.program_id(0).to(tl.int64)
    row, sub = pid // NUM_SUB, pid % NUM_SUB
    offs = tl.arange(0, BLOCK)
    ok = offs < SIZE
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x_row + sub * stride_x_sub + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The residual stream is rounded to the model dtype after the add, as in torch.
        res = tl.load(residual_ptr + row * SIZE + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * SIZE + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / SIZE + eps)
    # Sub-rows from SECOND_FROM take the second weight (k's heads after q's, one launch).
    first = (sub + 0 * offs) < SECOND_FROM
    weight = tl.load(weight_ptr + offs, mask=ok & first, other=0.0).to(tl.float32)
    if SECOND_FROM < NUM_SUB:
        second = tl.load(second_weight_ptr + offs, mask=ok & ~first, other=0.0)
        weight += second.to(tl.float32)
    if dtype == tl.float32:
        y = x32 * rstd * weight
    else:
        y = (x32 * rstd).to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * stride_out_row + sub * stride_out_sub + offs, y.to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    second: tuple[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual), x + residual), or (norm(x), None) without a residual.

    x is [rows, size] or [rows, sub, size] (q/k heads; unit last stride). Outputs are new
    contiguous tensors, or the norm goes into out (of x's shape; out=x normalises in place).
    second=(sub, weight): the sub-rows from sub on take that weight (q's and k's heads of
    one qkv view, each with its own norm)."""
    size = x.shape[-1]
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm needs a unit last stride, got strides {x.stride()}")
    num_sub = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    residual_out = None
    if residual is not None:
        if x.dim() != 2 or residual.shape != x.shape or not residual.is_contiguous():
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        residual_out = torch.empty_like(residual)
    second_from, second_weight = second if second is not None else (num_sub, weight)
    if not 0 <= second_from <= num_sub or second_weight.shape != weight.shape:
        raise ValueError(
            f"second weight {tuple(second_weight.shape)} from sub-row {second_from} of "
            f"{num_sub} (weight {tuple(weight.shape)})"
        )
    if rows * num_sub == 0:
        return out, residual_out
    sub_stride = x.stride(1) if x.dim() == 3 else 0
    out_sub_stride = out.stride(1) if x.dim() == 3 else 0
    _rms_norm_kernel[(rows * num_sub,)](
        out,
        out if residual_out is None else residual_out,
        x,
        x if residual is None else residual,
        weight,
        second_weight,
        eps,
        x.stride(0),
        sub_stride,
        out.stride(0),
        out_sub_stride,
        NUM_SUB=num_sub,
        SECOND_FROM=second_from,
        SIZE=size,
        BLOCK=triton.next_power_of_2(size),
        HAS_RESIDUAL=residual is not None,
        **launch_options(x.device),
    )
    return out, residual_out


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
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * SIZE + offs, (act * up).to(dtype), mask=ok)


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
