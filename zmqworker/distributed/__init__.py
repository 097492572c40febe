"""Parallel layouts across ranks: the process groups of tensor, pipeline and expert
parallelism and their collectives, the pipeline channel between stages (frames or a shared-memory
ring) and a stage's view of it.

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.cdiv.
"""

from zmqworker.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    expert_all_reduce,
    init_parallel_state,
    single_rank_state,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "ParallelState",
    "destroy_parallel_state",
    "expert_all_reduce",
    "init_parallel_state",
    "single_rank_state",
    "tp_all_gather",
    "tp_all_reduce",
]
