"""Configuration a worker receives at start-up, as one WorkerConfig message."""

from __future__ import annotations

import msgspec

from messages.kv_transfer import KVTransferConfig


class ModelConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Which checkpoint to run and how. path is a Hugging Face checkpoint folder."""

    path: str
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0
    # auto: the folder's safetensors; dummy: random weights made on the device from
    # config.json alone (benchmarks and checks of real shapes without weight files)
    load_format: str = "auto"
    enforce_eager: bool = False  # never capture CUDA graphs
    # The most top-n logprobs a request may ask for (-1: the whole vocabulary). It also
    # bounds the size of a reply, and so what the engine's socket takes in.
    max_logprobs: int = 20


class ParallelConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """The layout. A worker's rank within its data-parallel replica is
    pp_rank * tensor_parallel_size + tp_rank; the replicas of a host run side by side,
    and a worker's local rank (its GPU) is first_local_rank + data_parallel_rank *
    world_size + rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    distributed_init_method: str = ""  # torch.distributed init URL, e.g. tcp://127.0.0.1:port
    # Mixture-of-experts layers: each rank holds its share of the experts whole (over
    # tensor_parallel_size x data_parallel_size ranks) instead of a slice of every expert.
    enable_expert_parallel: bool = False
    # Another instance's ranks on this host (a disaggregated pair's): where this
    # instance's local ranks start, and every rank on the host whose cores a CPU worker
    # shares (0: this instance's own, world_size x data_parallel_size).
    first_local_rank: int = 0
    host_ranks: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_on_host(self) -> int:
        """The ranks sharing this host's cores and memory: host_ranks, or this layout's."""
        return self.host_ranks or self.world_size * self.data_parallel_size


class CacheConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """KV cache sizing. kv_cache_bytes, when set, overrides both memory rules."""

    block_size: int = 16
    cache_dtype: str = "auto"  # auto: the model dtype
    gpu_memory_utilization: float = 0.9
    cpu_memory_fraction: float = 0.25  # CPU budget: this fraction of available memory
    kv_cache_bytes: int | None = None
    # GiB of host memory for the host KV tier (blocks evicted from the prefix cache),
    # over every worker of a replica, each holding its own share; 0: no host tier.
    kv_offloading_size: float = 0.0


class DeviceConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    device: str = "auto"  # auto | cpu | cuda
    # auto: Triton kernels and CUDA graphs on CUDA, plain torch on the CPU; torch | triton
    kernels: str = "auto"
    # torch threads; None: OMP_NUM_THREADS if a count, else CPU workers share the host's cores
    num_threads: int | None = None


class ProfilerConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    profiler: str = "none"  # none | torch | cuda
    output_dir: str = ""


class SchedulerConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Limits the engine schedules within; the worker sizes profiling and warm-up from them."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    warmup_batch_sizes: list[int] = msgspec.field(default_factory=lambda: [1, 8])
    # decode batch sizes captured as CUDA graphs; empty: 1, 2, 4, 8, 16, ... max_num_seqs
    cuda_graph_sizes: list[int] = msgspec.field(default_factory=list)


class WorkerConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Everything a worker needs, sent in the Welcome message of the handshake."""

    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    device: DeviceConfig = DeviceConfig()
    profiler: ProfilerConfig = ProfilerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_transfer: KVTransferConfig | None = None  # None: no KV connector
    worker_cls: str = "zmqworker.worker.torch_worker.Worker"
    worker_extension_cls: str = ""
