"""How a mixture-of-experts layer is cut over ranks, without torch: the engine checks the
layout with it before any worker starts, and the workers' expert layers take their share.

Without expert parallelism every rank holds every expert, each cut along its intermediate
size over the TP group, as the dense MLP is. With it (enable_expert_parallel) the experts
are dealt out whole over the expert-parallel group: the TP ranks of a pipeline stage in
every data-parallel replica (ParallelState), so a rank reads and multiplies only its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeSizes:
    """A mixture-of-experts model's sizes, from its config.json."""

    num_experts: int
    top_k: int  # experts per token
    intermediate: int  # each expert's


def moe_sizes(config: Mapping[str, Any]) -> MoeSizes | None:
    """The sizes named in config.json (Qwen3-MoE's num_experts and moe_intermediate_size,
    Mixtral's num_local_experts and intermediate_size); None for a dense model."""
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        return None
    intermediate = config.get("moe_intermediate_size") or config.get("intermediate_size")
    top_k = config.get("num_experts_per_tok")
    for key, value in (("experts", num_experts), ("intermediate", intermediate), ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"mixture-of-experts config: {key} must be a positive int, got {value!r}"
            )
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} is more than the {num_experts} experts")
    return MoeSizes(num_experts, top_k, intermediate)


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's experts [first, first + count) of num_experts, each holding rows
    [inter_start, inter_start + inter_len) of its intermediate size."""

    num_experts: int
    first: int
    count: int
    inter_start: int
    inter_len: int


def check_expert_split(sizes: MoeSizes, tp_size: int, ep_size: int) -> None:
    """Refuse a layout the experts cannot be cut into, naming the numbers. ep_size > 1:
    expert parallelism over that many ranks."""
    if ep_size > 1:
        if sizes.num_experts % ep_size:
            raise ValueError(
                f"enable_expert_parallel: the model's {sizes.num_experts} experts are not "
                f"divisible by the expert-parallel size {ep_size} (tensor_parallel_size x "
                "data-parallel replicas)"
            )
    elif sizes.intermediate % tp_size:
        raise ValueError(
            f"the experts' intermediate size {sizes.intermediate} is not divisible by "
            f"tensor_parallel_size={tp_size} (enable_expert_parallel places whole experts)"
        )


def expert_split(
    sizes: MoeSizes, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int
) -> ExpertSplit:
    check_expert_split(sizes, tp_size, ep_size)
    if ep_size > 1:
        count = sizes.num_experts // ep_size
        return ExpertSplit(sizes.num_experts, ep_rank * count, count, 0, sizes.intermediate)
    inter_len = sizes.intermediate // tp_size
    return ExpertSplit(sizes.num_experts, 0, sizes.num_experts, tp_rank * inter_len, inter_len)
