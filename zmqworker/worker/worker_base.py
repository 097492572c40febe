"""WorkerBase: the hardware-agnostic interface the executor drives, after vLLM v1.

The methods named in RPC_METHODS are the whole surface an engine can call over the wire;
a worker extension class adds its own public methods to that list (see wrapper.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from messages import (
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    WorkerConfig,
)

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
        is_driver_worker: bool = False,
    ) -> None:
        world = config.parallel.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside the layout's {world} ranks (tp x pp)")
        self.config = config
        self._rank = rank
        self._local_rank = rank if local_rank is None else local_rank
        self._init_method = distributed_init_method or config.parallel.distributed_init_method
        self._is_driver = is_driver_worker

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def is_driver_worker(self) -> bool:
        return self._is_driver

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
        """Allocate exactly the blocks the engine chose."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> float:
        """Warm up (and capture graphs where supported); returns the seconds it took."""

    @abstractmethod
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
        sample: bool = True,
    ) -> object:
        """Run one step: a ModelRunnerOutput (possibly async) on the last pipeline stage,
        IntermediateTensors on the others, None when sampling is deferred."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> object:
        """Sample the logits kept by execute_model(sample=False)."""

    @abstractmethod
    def profile(self, is_start: bool = True) -> None:
        """Start or stop the configured profiler."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release device memory: level 1 offloads weights, level 2 drops them."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: "weights", "kv_cache", or both (None)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if this rank cannot serve."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release everything; safe after a partial start-up and safe to call twice."""
