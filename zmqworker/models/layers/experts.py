"""The experts of a mixture-of-experts layer: the router, this rank's experts stacked into
two parameters, and routing and the experts' computation in plain torch (the CPU path,
and the reference of the fused Triton kernels in fused_moe.py).

Routing is transformers': a softmax over every expert in float32, the top k, divided by
their sum where the family renormalises (Mixtral always; Qwen3-MoE by norm_topk_prob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zmqworker.models.expert_split import ExpertSplit
from zmqworker.models.layers.linear import SkinnyPath, linear
from zmqworker.models.layers.weights import OneOf, TensorSlice


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's experts are in a published checkpoint: `{block}.gate.weight` (the
    router) and `{block}.experts.{e}.{gate|up|down}.weight` under each layer. transformers
    keeps them as `mlp.gate.weight` and `mlp.experts.gate_up_proj` / `down_proj`, every
    expert's stacked, and may save them so."""

    block: str  # "mlp" (Qwen3-MoE) | "block_sparse_moe" (Mixtral)
    gate: str  # "gate_proj" | "w1"
    up: str  # "up_proj" | "w3"
    down: str  # "down_proj" | "w2"


def _sources(*layouts: tuple[TensorSlice, ...]) -> OneOf | list[TensorSlice]:
    """One layout as a list; several (published and stacked names differ) as OneOf."""
    unique = tuple(dict.fromkeys(layouts))
    return list(unique[0]) if len(unique) == 1 else OneOf(unique)


class Router(nn.Module):
    """The gate: [tokens, hidden] -> [tokens, num_experts] logits, whole on every rank.
    On the CUDA path decode-sized steps may take the skinny kernel (linear.SkinnyPath)."""

    def __init__(self, hidden: int, num_experts: int, names: ExpertNames, layer: str, skinny: bool):
        super().__init__()
        self.names = names
        self.layer = layer
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.project = SkinnyPath(num_experts, hidden, skinny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.weight, None)

    def tensor_slices(self) -> dict[str, OneOf | list[TensorSlice]]:
        shape = tuple(self.weight.shape)
        return {
            "weight": _sources(
                *(
                    (TensorSlice(f"{self.layer}.{block}.gate.weight", shape, 0, 0, shape[0], 0),)
                    for block in (self.names.block, "mlp")
                )
            )
        }


class StackedExperts(nn.Module):
    """This rank's experts (split): w13 [count, 2 * inter_len, hidden], each expert's gate
    rows then its up rows, and w2 [count, hidden, inter_len]."""

    def __init__(
        self, hidden: int, intermediate: int, split: ExpertSplit, names: ExpertNames, layer: str
    ):
        super().__init__()
        self.hidden = hidden
        self.intermediate = intermediate
        self.split = split
        self.names = names
        self.layer = layer
        count, inter = split.count, split.inter_len
        self.w13 = nn.Parameter(torch.empty(count, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(count, hidden, inter), requires_grad=False)

    def tensor_slices(self) -> dict[str, OneOf | list[TensorSlice]]:
        s, n = self.split, self.names
        inter, start = s.inter_len, s.inter_start
        rows = (self.intermediate, self.hidden)
        published = f"{self.layer}.{n.block}.experts"
        w13: list[TensorSlice] = []
        w2: list[TensorSlice] = []
        for j in range(s.count):
            expert = f"{published}.{s.first + j}"
            for dst, proj in ((0, n.gate), (inter, n.up)):
                w13.append(TensorSlice(f"{expert}.{proj}.weight", rows, 0, start, inter, dst, j))
            down = (self.hidden, self.intermediate)
            w2.append(TensorSlice(f"{expert}.{n.down}.weight", down, 1, start, inter, 0, j))
        experts = (s.first, s.count)
        gate_up = f"{self.layer}.mlp.experts.gate_up_proj"
        full = (s.num_experts, 2 * self.intermediate, self.hidden)
        stacked_w13 = tuple(
            TensorSlice(gate_up, full, 0, offset + start, inter, dst, src_experts=experts)
            for offset, dst in ((0, 0), (self.intermediate, inter))
        )
        down_full = (s.num_experts, self.hidden, self.intermediate)
        stacked_w2 = TensorSlice(
            f"{self.layer}.mlp.experts.down_proj", down_full, 1, start, inter, 0,
            src_experts=experts,
        )  # fmt: skip
        return {
            "w13": OneOf((tuple(w13), stacked_w13)),
            "w2": OneOf((tuple(w2), (stacked_w2,))),
        }


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [tokens, top_k], expert ids int64 [tokens, top_k]), as
    transformers routes."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int,
    act: nn.Module,
) -> torch.Tensor:
    """For each token, the sum over its experts held here (first_expert onwards, as many
    as w13 stacks) of weight * down(act(gate_up(x))), in x's dtype. Expert by expert over
    the tokens that chose it; each (token, choice)'s product is rounded to x's dtype, and
    a token's are summed in choice order (as the fused kernel sums them).
    act: [n, 2 * inter] -> [n, inter]."""
    count, top_k = w13.shape[0], ids.shape[1]
    local = (ids - first_expert).flatten()
    local = torch.where((local >= 0) & (local < count), local, count)  # count: elsewhere
    order = torch.argsort(local, stable=True)
    sizes = torch.bincount(local, minlength=count + 1)[:count].tolist()
    flat_weights = weights.flatten()
    # Index copies, not index_add_: on a loaded CPU its threaded kernel took milliseconds.
    products = x.new_zeros(ids.numel(), x.shape[1])
    start = 0
    for expert, size in enumerate(sizes):
        if size:
            pairs = order[start : start + size]
            hidden = act(linear(x[pairs // top_k], w13[expert]))
            hidden = linear(hidden, w2[expert]) * flat_weights[pairs, None]
            products.index_copy_(0, pairs, hidden.to(x.dtype))
        start += size
    return products.view(ids.shape[0], top_k, -1).sum(dim=1)
