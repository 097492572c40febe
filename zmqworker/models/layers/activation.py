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
    """act(gate) * up, where x = [gate | up] along the last dim."""

    def __init__(self, hidden_act: str):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {hidden_act!r}; supported: {sorted(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
