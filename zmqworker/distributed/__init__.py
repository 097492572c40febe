"""Process groups for tensor and pipeline parallelism."""

from zmqworker.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    single_rank_state,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "ParallelState",
    "destroy_parallel_state",
    "init_parallel_state",
    "single_rank_state",
    "tp_all_gather",
    "tp_all_reduce",
]
