"""An engine's plan, made from the LLM's options before any process starts: the model
folder read and checked, the layout checked against the model and the visible GPUs,
device and dtype resolved, and the configuration of every engine core (a data-parallel
replica each). The LLM and the `serve` command's main process both start from one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from messages import (
    CacheConfig,
    DeviceConfig,
    EngineCoreConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from zmqworker.cdiv import cdiv
from zmqworker.engine.core_limits import engine_core_limits
from zmqworker.engine.model_folder import ModelFolder, cache_config_for
from zmqworker.frontend.devices import (
    check_gpu_layout,
    resolve_device,
    resolve_dtype,
    visible_gpu_count,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnginePlan:
    folder: ModelFolder
    worker_config: WorkerConfig  # every replica's, but its data_parallel_rank
    num_engines: int
    executor: str | Callable[[WorkerConfig], Any]
    async_scheduling: bool
    enable_prefix_caching: bool
    step_timeout_s: float | None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EnginePlan:
        """options: every argument of LLM (checked already). Raises ValueError or
        FileNotFoundError naming what is wrong."""
        o = options
        tp, pp, dp = o["tensor_parallel_size"], o["pipeline_parallel_size"], o["data_parallel_size"]
        folder = ModelFolder.open(o["model"])
        folder.check_layout(tp, pp, o["enable_expert_parallel"])
        max_model_len = folder.max_model_len(o["max_model_len"])
        gpus = visible_gpu_count()
        device, device_why = resolve_device(o["device"], gpus)
        saved_dtype = folder.config.get("dtype") or folder.config.get("torch_dtype")
        dtype, dtype_why = resolve_dtype(o["dtype"], device, saved_dtype)
        executor = o["executor"]
        local = not callable(executor) and executor == "mp"
        if device == "cuda" and local:
            check_gpu_layout(dp, tp, pp, gpus)
        if o["kv_offloading_size"] and not o["enable_prefix_caching"]:
            raise ValueError(
                f"kv_offloading_size={o['kv_offloading_size']}: the host KV tier keeps the "
                "blocks the prefix cache evicts, so it needs enable_prefix_caching=True"
            )
        block_size, max_num_seqs = o["block_size"], o["max_num_seqs"]
        # A step holds at most this many requests (a token each): the runner's bound.
        max_batch = min(max_num_seqs, o["max_num_batched_tokens"])
        cache = cache_config_for(
            folder,
            CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=o["gpu_memory_utilization"],
                cpu_memory_fraction=o["cpu_memory_fraction"] or CacheConfig().cpu_memory_fraction,
                kv_cache_bytes=o["kv_cache_bytes"],
                kv_offloading_size=o["kv_offloading_size"],
            ),
            num_blocks=max_num_seqs * cdiv(max_model_len, block_size),
            fill=o["cpu_memory_fraction"] is not None,
            dtype=dtype,
            tp=tp,
            pp=pp,
            local_cpu=local and device == "cpu",
            replicas=dp,
        )
        worker_config = WorkerConfig(
            model=ModelConfig(
                path=str(folder.path),
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=o["load_format"],
                seed=o["seed"],
                max_logprobs=o["max_logprobs"],
                enforce_eager=o.get("enforce_eager", False),
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                data_parallel_size=dp,
                enable_expert_parallel=o["enable_expert_parallel"],
            ),
            cache=cache,
            device=DeviceConfig(device=device, num_threads=o["num_threads"]),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=o["max_num_batched_tokens"],
                # Workers warm up with batches of these sizes: none above a step's.
                warmup_batch_sizes=sorted(
                    {min(size, max_batch) for size in SchedulerConfig().warmup_batch_sizes}
                ),
            ),
            worker_extension_cls=o["worker_extension_cls"],
        )
        logger.info(
            "%d engine core(s) of %d worker(s) on %s (%s), %s (%s); model %s",
            dp, tp * pp, device, device_why, dtype, dtype_why, folder.path,
        )  # fmt: skip
        return cls(
            folder=folder,
            worker_config=worker_config,
            num_engines=dp,
            executor=executor,
            async_scheduling=o["async_scheduling"],
            enable_prefix_caching=o["enable_prefix_caching"],
            step_timeout_s=o["step_timeout_s"],
        )

    @property
    def make_executor(self) -> Callable[[WorkerConfig], Any] | None:
        """A factory of executors made in this process (the engine cores then run in
        threads here), or None: engine core processes with a named executor."""
        return self.executor if callable(self.executor) else None

    @property
    def max_logprobs(self) -> int:
        return self.worker_config.model.max_logprobs

    @property
    def output_bytes(self) -> int:
        """The largest frame a client's socket takes in from an engine core."""
        return engine_core_limits(self.worker_config).output_bytes

    def engine_config(self, index: int, address: str, token: str) -> EngineCoreConfig:
        """Replica index's configuration, bound at address, admitting token."""
        parallel = msgspec.structs.replace(self.worker_config.parallel, data_parallel_rank=index)
        level = logging.getLogger("zmqworker").getEffectiveLevel()
        return EngineCoreConfig(
            worker=msgspec.structs.replace(self.worker_config, parallel=parallel),
            address=address,
            token=token,
            engine_index=index,
            executor="mp" if callable(self.executor) else self.executor,  # type: ignore[arg-type]
            async_scheduling=self.async_scheduling,
            enable_prefix_caching=self.enable_prefix_caching,
            step_timeout_s=self.step_timeout_s,
            vocab_size=self.folder.vocab_size,
            log_level=logging.getLevelName(level),
        )
