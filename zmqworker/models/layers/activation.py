"""Gated activation of the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """act(gate) * up, where x = [gate | up] along the last dim. fused=True runs SiLU as
    one Triton kernel (the other activations stay eager)."""

    def __init__(self, hidden_act: str, fused: bool = False):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r}; supported: {sorted(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[hidden_act]
        self._fused = None
        if fused and hidden_act == "silu":
            from zmqworker.models.layers.triton_ops import silu_and_mul

            self._fused = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused(x)
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
