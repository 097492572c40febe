"""RMSNorm as the Llama family computes it: statistics in float32, then the weight in the
input dtype (the same rounding as transformers). fused=True runs it as one Triton kernel
(triton_ops.py), the residual add included, with the same rounding."""

from __future__ import annotations

import torch
from torch import nn

from zmqworker.models.layers.weights import TensorSlice, whole


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, prefix: str, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.prefix = prefix
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self._fused = None
        if fused:
            from zmqworker.models.layers.triton_ops import rms_norm

            self._fused = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32:
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm residual stream step."""
        if self._fused is not None:
            out, residual = self._fused(x, self.weight, self.eps, residual)
            assert residual is not None
            return out, residual
        residual = x + residual
        return self.forward(residual), residual

    def tensor_slices(self) -> dict[str, list[TensorSlice]]:
        return {"weight": [whole(f"{self.prefix}.weight", tuple(self.weight.shape))]}
