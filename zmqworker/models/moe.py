"""The mixture-of-experts block that takes the MLP's place in the sparse layers of
Qwen3-MoE and Mixtral: the router, this rank's experts, and the combine across ranks.

Each rank computes its part of every token's output: without expert parallelism, every
expert over its slice of the intermediate size; with it, its own experts whole (others'
tokens give zero here). The parts are summed over the ranks that share the layer
(distributed.expert_all_reduce), so every rank ends with the whole output, as after the
dense MLP's row-parallel projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zmqworker.distributed.parallel_state import ParallelState, expert_all_reduce
from zmqworker.models.expert_split import expert_split, moe_sizes
from zmqworker.models.layers.activation import GatedActivation
from zmqworker.models.layers.experts import (
    ExpertNames,
    Router,
    StackedExperts,
    experts_reference,
    route,
)


@dataclass(frozen=True)
class MoeFlags:
    """How a family's mixture-of-experts layers differ: checkpoint names and routing."""

    names: ExpertNames
    renormalize: bool  # the top-k weights are divided by their sum


def sparse_layer(cfg: Any, layer: int) -> bool:
    """Whether a layer's MLP is a mixture of experts (Qwen3-MoE's decoder_sparse_step and
    mlp_only_layers; every layer of Mixtral)."""
    if layer in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (moe_sizes(cfg.to_dict()) is not None) and (layer + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """fused=True runs the experts as the fused Triton MoE (fused_moe.py: CUDA steps,
    graph-safe); the plain-torch experts stay the reference and the CPU path."""

    def __init__(self, cfg: Any, flags: MoeFlags, layer: str, state: ParallelState, fused: bool):
        super().__init__()
        sizes = moe_sizes(cfg.to_dict())
        if sizes is None:
            raise ValueError(f"{layer}: the config names no experts")
        self.state = state
        self.top_k = sizes.top_k
        self.renormalize = flags.renormalize
        self.split = expert_split(sizes, state.tp_size, state.tp_rank, state.ep_size, state.ep_rank)
        hidden = cfg.hidden_size
        self.gate = Router(hidden, sizes.num_experts, flags.names, layer, skinny=fused)
        self.experts = StackedExperts(hidden, sizes.intermediate, self.split, flags.names, layer)
        self.act = GatedActivation(cfg.hidden_act)
        self._fused = None
        if fused:
            if cfg.hidden_act != "silu":
                raise ValueError(
                    f"the fused mixture of experts runs hidden_act silu, not {cfg.hidden_act!r}"
                )
            from zmqworker.models.layers.fused_moe import fused_moe

            self._fused = fused_moe

    def token_starts(self) -> list[int]:
        """The fewest tokens of each of the fused experts' tile sets (none unfused)."""
        if self._fused is None:
            return []
        from zmqworker.models.layers.fused_moe import token_starts

        return token_starts(self.top_k, self.split.count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        w13, w2 = self.experts.w13, self.experts.w2
        if self._fused is not None:
            out = self._fused(x, logits, w13, w2, self.top_k, self.renormalize, self.split.first)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
            out = experts_reference(x, w13, w2, weights, ids, self.split.first, self.act)
        return expert_all_reduce(out, self.state)
