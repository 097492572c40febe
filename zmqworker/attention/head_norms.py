"""The RMSNorms some families (Qwen3) apply to every query head and every key head before
rotary, as the Triton attention kernels take them (triton_cache.py, triton_decode.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class HeadNorms(NamedTuple):
    """The q and k norms' weights ([head_dim] each, the model dtype) and their eps."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float

    def check(self, head_dim: int, dtype: torch.dtype) -> None:
        """Refuse weights that are not a contiguous [head_dim] of the model dtype."""
        for name, w in (("q", self.q), ("k", self.k)):
            if w.shape != (head_dim,) or w.dtype != dtype or not w.is_contiguous():
                raise ValueError(
                    f"the {name} head norm's weight is {tuple(w.shape)} {w.dtype}; the "
                    f"heads need a contiguous [{head_dim}] {dtype}"
                )


def norm_args(
    norms: HeadNorms | None, head_dim: int, dtype: torch.dtype, unused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The q weight, k weight and eps an attention kernel takes: norms', checked against
    the heads; without norms (QK_NORM off), unused's pointer twice and 0.0."""
    if norms is None:
        return unused, unused, 0.0
    norms.check(head_dim, dtype)
    return norms
