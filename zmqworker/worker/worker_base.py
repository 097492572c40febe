"""WorkerBase: the hardware-agnostic interface the executor drives, after vLLM v1.

The methods named in RPC_METHODS are the whole surface an engine can call over the wire;
a worker extension class adds its own public methods to that list (see wrapper.py).
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod

from messages import (
    CudaWeights,
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    SharedWeights,
    WeightUpdate,
    WorkerConfig,
)
from zmqworker.distributed.pipeline_stage import PipelineStage

# The start-up order: init_device -> load_model -> determine_available_memory ->
# get_kv_cache_spec -> (engine picks num_blocks) -> initialize_from_config ->
# compile_or_warm_up_model; only then execute_model / sample_tokens.
RPC_METHODS = frozenset(
    {
        "init_device",
        "load_model",
        "determine_available_memory",
        "get_kv_cache_spec",
        "initialize_from_config",
        "compile_or_warm_up_model",
        "execute_model",
        "sample_tokens",
        "profile",
        "sleep",
        "wake_up",
        "start_weight_update",
        "load_weight_chunk",
        "finish_weight_update",
        "abort_weight_update",
        "init_weight_transfer_group",
        "update_weights_from_group",
        "reload_weights",
        "check_health",
        "shutdown",
    }
)


class WorkerBase(ABC):
    """One rank of the model: a slice of its weights, its KV cache, its process groups."""

    def __init__(
        self,
        config: WorkerConfig,
        rank: int,
        local_rank: int | None = None,
        distributed_init_method: str | None = None,
        pipeline: PipelineStage | None = None,
    ) -> None:
        """pipeline: where a step's input tensors come from and its outputs go, on a
        pipeline stage served by a worker process (None: a worker used in process)."""
        world = config.parallel.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside the layout's {world} ranks (tp x pp)")
        parallel = config.parallel
        if parallel.first_local_rank < 0 or parallel.host_ranks < 0:
            raise ValueError(
                f"first_local_rank={parallel.first_local_rank} and host_ranks="
                f"{parallel.host_ranks} must be >= 0"
            )
        self.config = config
        self.pipeline = pipeline
        self._rank = rank
        # Data-parallel replicas on one host: each replica's ranks take the next GPUs,
        # after those of another instance on the host (first_local_rank).
        replica_offset = parallel.first_local_rank + parallel.data_parallel_rank * world
        self._local_rank = replica_offset + rank if local_rank is None else local_rank
        self._init_method = distributed_init_method or config.parallel.distributed_init_method

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def distributed_init_method(self) -> str:
        return self._init_method

    @abstractmethod
    def init_device(self) -> None:
        """Pick the device and join the process groups, before any memory is measured."""

    @abstractmethod
    def load_model(self) -> None:
        """Load this rank's share of the weights."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes this rank can give to the KV cache, after profiling a full batch."""

    @abstractmethod
    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The shape of this rank's attention layers' KV cache."""

    @abstractmethod
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate exactly the blocks the engine chose; refused (RuntimeError) while
        unfinished requests' KV lies in the cache it would replace."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> float:
        """Warm up (and capture graphs where supported); returns the seconds it took.
        Refused (RuntimeError) while requests are unfinished: warm-up writes the cache."""

    @abstractmethod
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        sample: bool = True,
        *,
        call_id: int = 0,
        deadline: float = 0.0,
    ) -> object:
        """Run one step: a ModelRunnerOutput (possibly async) on the last pipeline stage,
        None when sampling is deferred. A stage before the last sends its tensors to the
        next stage and returns None (without a pipeline: returns the tensors). call_id:
        the RPC call's id (the runtime passes it), which names the step's tensors;
        deadline: the call's (RpcRequest.deadline, a time.time() instant; 0: none), until
        which a later stage waits for the step's tensors."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> object:
        """Sample the logits kept by execute_model(sample=False): a ModelRunnerOutput
        (possibly async) on the last pipeline stage, None on the others."""

    @abstractmethod
    def profile(self, is_start: bool = True) -> None:
        """Start or stop the configured profiler."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release device memory: level 1 offloads weights, level 2 drops them."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: "weights", "kv_cache", or both (None)."""

    # Weight updates (docs/protocol.md, "Weight updates"): an update is announced whole
    # and checked before any weight changes; its bytes come in chunks.

    @abstractmethod
    def start_weight_update(self, update: WeightUpdate) -> None:
        """Check an update's announcement against the model; chunks may follow."""

    @abstractmethod
    def load_weight_chunk(self, chunk: SharedWeights | CudaWeights) -> None:
        """Copy this rank's slices of a chunk's tensors into its weights, in place."""

    @abstractmethod
    def finish_weight_update(self) -> None:
        """End the update; every announced tensor must have come."""

    @abstractmethod
    def abort_weight_update(self) -> None:
        """End the update where it is (weights half-written refuse steps)."""

    @abstractmethod
    def init_weight_transfer_group(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float = 300.0
    ) -> None:
        """Join a trainer's weight-transfer group as rank rank_offset + this rank."""

    @abstractmethod
    def update_weights_from_group(self, update: WeightUpdate) -> None:
        """Receive the announced update from the group's trainer."""

    @abstractmethod
    def reload_weights(self, path: str | None = None) -> None:
        """Load the weights again from the start-up checkpoint or another of its kind."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if this rank cannot serve."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release everything; safe after a partial start-up and safe to call twice."""


def freeze_startup_heap() -> None:
    """For the end of compile_or_warm_up_model: start-up is over, and what it made
    (modules, the model, its config and tokenizer files) lives as long as the process.
    Out of the collector's sight, a full collection no longer walks it, so no step pays
    for walking it (docs/cuda.md, the host side)."""
    gc.collect()
    gc.freeze()
