"""This rank's place in the tensor/pipeline/expert-parallel layout, and the collectives
layers use.

Rank layout: rank = pp_rank * tp_size + tp_rank. TP groups hold the ranks of one pipeline
stage; PP groups hold the ranks with the same tp_rank across stages. With expert
parallelism (ParallelConfig.enable_expert_parallel) a stage's mixture-of-experts layers
deal their experts out over its EP group: its TP ranks in every data-parallel replica, as
vLLM's (expert_group_ranks). One replica makes a world today, so the EP group is the TP
group; replicas that join one world make it span them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from messages import ParallelConfig

# The TP, PP and EP groups' bound on a collective (their creation included), where torch's
# default is 30 minutes: a rank that died mid-set-up or mid-step holds the others this
# long at most where nothing else watches them, and a rank's first kernel compiles fit.
GROUP_TIMEOUT_S = 600.0

# Whether this module called init_process_group, so destroy only tears down what it built.
_initialised_here = False


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_group: ProcessGroup | None  # None when tp_size == 1
    pp_group: ProcessGroup | None  # None when pp_size == 1
    device: torch.device
    # Expert parallelism: ep_size 1 when off (experts are cut over the TP group instead).
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: ProcessGroup | None = None  # None when ep_size == 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def expert_group_ranks(tp_size: int, pp_size: int, dp_size: int, pp_rank: int) -> list[int]:
    """The global ranks of pipeline stage pp_rank's expert-parallel group, in ep_rank order
    (ep_rank = dp_rank * tp_size + tp_rank), where a replica's ranks follow the previous
    replica's: global rank = dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank."""
    return [
        dp * tp_size * pp_size + pp_rank * tp_size + t
        for dp in range(dp_size)
        for t in range(tp_size)
    ]


def single_rank_state(device: torch.device) -> ParallelState:
    """The layout of a lone worker: no groups, no torch.distributed."""
    return ParallelState(0, 1, 0, 1, 0, 1, None, None, torch.device(device))


def init_parallel_state(
    parallel: ParallelConfig, rank: int, device: torch.device, timeout_s: float = 60.0
) -> ParallelState:
    """Join the process group of `parallel` (when world_size > 1) and build the TP/PP groups."""
    global _initialised_here
    device = torch.device(device)
    tp_size = parallel.tensor_parallel_size
    pp_size = parallel.pipeline_parallel_size
    if tp_size < 1 or pp_size < 1:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) and pipeline_parallel_size ({pp_size}) must be >= 1"
        )
    world_size = tp_size * pp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the layout tp={tp_size} x pp={pp_size}")
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    # One data-parallel replica per world for now: its EP group is its TP group.
    ep_size = tp_size if parallel.enable_expert_parallel else 1
    if world_size == 1:
        return ParallelState(0, 1, 0, 1, 0, 1, None, None, device)
    if not parallel.distributed_init_method:
        raise ValueError(
            f"world size {world_size} (tp={tp_size} x pp={pp_size}) needs "
            "ParallelConfig.distributed_init_method, e.g. tcp://127.0.0.1:29500"
        )
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=parallel.distributed_init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        _initialised_here = True
    # new_group is collective: every rank creates every group, in the same order.
    tp_group = pp_group = ep_group = None
    new_group = functools.partial(dist.new_group, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    for stage in range(pp_size):
        tp_ranks = [stage * tp_size + t for t in range(tp_size)]
        group = new_group(tp_ranks) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = group
        if ep_size > 1:
            ep_ranks = expert_group_ranks(tp_size, pp_size, 1, stage)
            # A world of one replica: the TP group's ranks, and its group.
            ep = group if ep_ranks == tp_ranks else new_group(ep_ranks)
            if stage == pp_rank:
                ep_group = ep
    for t in range(tp_size):
        ranks = [stage * tp_size + t for stage in range(pp_size)]
        group = new_group(ranks) if pp_size > 1 else None
        if t == tp_rank:
            pp_group = group
    return ParallelState(
        rank,
        world_size,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        tp_group,
        pp_group,
        device,
        ep_rank=tp_rank,
        ep_size=ep_size,
        ep_group=ep_group,
    )


def destroy_parallel_state() -> None:
    """Leave the process group this module joined; safe to call twice or without init."""
    global _initialised_here
    if _initialised_here and dist.is_initialized():
        dist.destroy_process_group()
    _initialised_here = False


def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum x over the TP group (in place); x itself when there is no group."""
    if state.tp_group is None:
        return x
    dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's x along dim, in tp_rank order."""
    if state.tp_group is None:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    return torch.cat(parts, dim=dim)


def expert_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum x over the ranks that share a mixture-of-experts layer's work (in place): the
    EP group, or the TP group when every rank holds a slice of every expert."""
    group = state.ep_group if state.ep_size > 1 else state.tp_group
    if group is not None:
        dist.all_reduce(x, group=group)
    return x
