"""RMSNorm's arithmetic in Triton, in one place, so that every kernel that normalises rounds
as the torch layer does (models/layers/norm.py): statistics in float32, x * rstd rounded to
the model dtype before the weight, the product rounded again. The fused RMSNorm kernel
(models/layers/triton_ops.py) and the attention kernels' q and k norms
(attention/triton_cache.py, triton_decode.py) take it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_rstd(sum_sq, eps, SIZE: tl.constexpr):
    """1 / RMS of a row of SIZE values from the sum of their squares (float32)."""
    return tl.rsqrt(sum_sq / SIZE + eps)


@triton.jit
def rms_apply(x, rstd, weight, OUT_DTYPE: tl.constexpr):
    """x * rstd * weight (float32 in and out), rounded as the RMSNorm layer rounds."""
    if OUT_DTYPE == tl.float32:
        return x * rstd * weight
    return ((x * rstd).to(OUT_DTYPE).to(tl.float32) * weight).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def rms_apply_pair(
    a, b, sum_sq, weight_ptr, offs_a, offs_b, mask, eps, SIZE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Two parts of the same rows (a head's halves, or a head and its rotary partners),
    normalised by the rows' sum of squares (shaped to broadcast over them), with the
    weight's elements at offs_a and offs_b (masked by mask)."""
    rstd = rms_rstd(sum_sq, eps, SIZE)
    w_a = tl.load(weight_ptr + offs_a, mask=mask, other=0.0).to(tl.float32)
    w_b = tl.load(weight_ptr + offs_b, mask=mask, other=0.0).to(tl.float32)
    return rms_apply(a, rstd, w_a, OUT_DTYPE), rms_apply(b, rstd, w_b, OUT_DTYPE)
