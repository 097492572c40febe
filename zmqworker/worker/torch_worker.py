"""The torch Worker for CPU and CUDA: holds the device, the process groups, the model
runner and its KV cache. The forward pass itself belongs to the model runner."""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import torch

from messages import (
    CudaWeights,
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    SharedWeights,
    WeightUpdate,
    WorkerConfig,
)
from zmqworker.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
)
from zmqworker.distributed.pipeline_stage import PipelineStage
from zmqworker.kv_transfer import KVConnector, make_kv_connector, take_orders
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.model_runner import ModelRunner
from zmqworker.worker.device import DeviceOps, device_ops
from zmqworker.worker.host_malloc import keep_freed_memory
from zmqworker.worker.sleep_mode import SleepState
from zmqworker.worker.weight_transfer import WeightTransferEngine
from zmqworker.worker.worker_base import WorkerBase, freeze_startup_heap

PROFILERS = ("none", "torch", "cuda")
HEALTH_OP_TIMEOUT_S = 10.0
# A step running longer than this means the model runner is wedged.
STEP_WEDGED_AFTER_S = 600.0
# A step computing nothing while KV transfers run (the engine polls) waits for one this long.
KV_POLL_WAIT_S = 0.02


class Worker(WorkerBase):
    def __init__(
        self,
        config: WorkerConfig,
        rank: int,
        local_rank: int | None = None,
        distributed_init_method: str | None = None,
        pipeline: PipelineStage | None = None,
    ) -> None:
        super().__init__(config, rank, local_rank, distributed_init_method, pipeline)
        if config.profiler.profiler not in PROFILERS:
            raise ValueError(
                f"profiler.profiler must be one of {', '.join(PROFILERS)}, "
                f"got {config.profiler.profiler!r}"
            )
        self.ops: DeviceOps = device_ops(config.device.device)
        self.device: torch.device | None = None
        self.state: ParallelState | None = None
        self.model_runner: ModelRunner | None = None
        self.weight_transfer: WeightTransferEngine | None = None
        self.kv_connector: KVConnector | None = None
        self._kv_cache_config: KVCacheConfig | None = None
        self._available_kv_bytes: int | None = None
        self._host_free_at_start = 0
        self.graph_bytes = 0  # what determine_available_memory set aside for CUDA graphs
        self._profiler: torch.profiler.profile | None = None
        self._sleep = SleepState()
        self._step_started: float | None = None
        self._shut_down = False

    # start-up -------------------------------------------------------------------------

    def init_device(self) -> None:
        self.device = self.ops.select(self.local_rank)
        threads = self.config.device.num_threads
        if threads is None and self.device.type == "cpu":
            # The host's workers (host_ranks: another instance's too) share its cores;
            # torch's default (all of them in each) slows every rank down severalfold.
            cores = len(os.sched_getaffinity(0))
            ranks = self.config.parallel.ranks_on_host
            threads = _omp_num_threads() or max(1, cores // ranks)
        if threads:
            torch.set_num_threads(threads)
        parallel = self.config.parallel
        if self.distributed_init_method != parallel.distributed_init_method:
            parallel = msgspec.structs.replace(
                parallel, distributed_init_method=self.distributed_init_method
            )
        self.state = init_parallel_state(parallel, self.rank, self.device)
        self._host_free_at_start = self.ops.free_and_total_bytes()[0]
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        if self.state is None:
            raise RuntimeError("init_device has not run: call it first")
        if self.model_runner is not None:
            raise RuntimeError(f"rank {self.rank}: the model is already loaded")
        self.model_runner = ModelRunner(self.config, self.state)
        self.weight_transfer = WeightTransferEngine(self.model_runner.model, self.config.model)

    def determine_available_memory(self) -> int:
        runner = self._runner()
        cache = self.config.cache
        if cache.kv_cache_bytes is not None:
            self._available_kv_bytes = cache.kv_cache_bytes
            return cache.kv_cache_bytes
        self.ops.empty_cache()
        in_use = self.ops.reset_peak()
        runner.profile_run()
        self.ops.synchronize()
        activation_peak = max(0, self.ops.peak_bytes() - in_use)
        self.ops.empty_cache()
        if self.ops.name == "cuda":
            # The graphs' memory stays taken once captured: the KV cache leaves it.
            self.graph_bytes = runner.probe_graph_memory()
            free, total = self.ops.free_and_total_bytes()
            budget = int(total * cache.gpu_memory_utilization) - (total - free)
            available = budget - activation_peak - self.graph_bytes
        else:
            # The host is shared by every worker on it: each gets its share.
            share = cache.cpu_memory_fraction / self.config.parallel.ranks_on_host
            budget = int(self._host_free_at_start * share)
            # The penalties' counts were made with the runner (on CUDA: taken already).
            penalties = runner.batch.penalties
            held = _weights_bytes(runner.model) + (penalties.nbytes if penalties else 0)
            available = budget - held - activation_peak
        self._available_kv_bytes = max(0, available)
        return self._available_kv_bytes

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self._runner().get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        runner = self._runner()
        # Refused first: the free memory checked below leaves out the cache in use.
        runner.check_kv_unused()
        spec = runner.get_kv_cache_spec()
        need = kv_cache_config.num_blocks * spec.page_size_bytes * len(spec.layer_names)
        free = self.ops.free_and_total_bytes()[0]
        limit = free if self._available_kv_bytes is None else min(free, self._available_kv_bytes)
        if self.config.cache.kv_cache_bytes is not None:
            limit = min(free, self.config.cache.kv_cache_bytes)
        if need > limit:
            raise ValueError(
                f"KV cache of {kv_cache_config.num_blocks} blocks needs {need} bytes on rank "
                f"{self.rank} ({len(spec.layer_names)} layers x {spec.page_size_bytes} bytes "
                f"per block), but only {limit} bytes are available"
            )
        runner.initialize_kv_cache(kv_cache_config)
        self._kv_cache_config = kv_cache_config
        wanted = self.config.kv_transfer is not None or kv_cache_config.num_host_blocks > 0
        if wanted and self.kv_connector is None:
            assert self.state is not None
            self.kv_connector = make_kv_connector(
                self.config.kv_transfer,
                kv_cache_config.num_host_blocks,
                lambda: runner.kv_caches,
                spec,
                self.state,
                _num_kv_heads(runner.model.hf_config),
                lambda: runner.shared_kv,
                runner.model.hf_config.num_hidden_layers,
            )

    def compile_or_warm_up_model(self) -> float:
        start = time.perf_counter()
        self._runner().warm_up(list(self.config.scheduler.warmup_batch_sizes))
        self.ops.synchronize()
        freeze_startup_heap()
        if self.device.type == "cpu":
            keep_freed_memory()  # for the steps from here on: host_malloc.py says why
        return time.perf_counter() - start

    # steps ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput, sample: bool = True, *,
                      call_id: int = 0, deadline: float = 0.0) -> object:  # fmt: skip
        self._require_awake("execute_model")
        runner = self._runner()
        pipeline = self.pipeline
        # Posted before the step is checked, waited for by the runner before it applies it.
        inputs = pipeline.receive(call_id, deadline) if pipeline is not None else None
        computes = scheduler_output.total_num_scheduled_tokens > 0
        self._step_started = time.monotonic()
        connector, kv_orders = self.kv_connector, scheduler_output.kv_connector_metadata
        wait_s = 0.0 if computes else KV_POLL_WAIT_S
        try:
            if kv_orders is not None:
                take_orders(kv_orders, connector)
            start = None if connector is None else partial(connector.before_step, kv_orders)
            output = runner.execute_model(scheduler_output, inputs, sample, start)
            if connector is not None:
                connector.after_step(kv_orders)
                if isinstance(output, AsyncModelRunnerOutput):
                    output.kv_connector_output = connector.take_output(wait_s)
        except BaseException as exc:
            if pipeline is not None and computes:
                pipeline.refuse(call_id, exc)  # the next stage would wait for its tensors
            raise
        finally:
            self._step_started = None
            if pipeline is not None:
                pipeline.done(call_id)
        if isinstance(output, IntermediateTensors) and pipeline is not None:
            if computes:  # else there are no tensors for the next stage, nor a wait there
                pipeline.send(call_id, output)  # does not wait for the next stage
            # Once the tensors are on their way: the next stage does not wait for the
            # copies of arrived KV. The engine's executor combines the stages' reports.
            return None if connector is None else connector.take_output(wait_s)
        return output

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> object:
        self._require_awake("sample_tokens")
        output = self._runner().sample_tokens(grammar_output)
        if self.kv_connector is not None and isinstance(output, AsyncModelRunnerOutput):
            output.kv_connector_output = self.kv_connector.take_output()
        return output

    # operations -----------------------------------------------------------------------

    def profile(self, is_start: bool = True) -> None:
        kind = self.config.profiler.profiler
        if kind == "none":
            raise RuntimeError(
                "no profiler configured: set profiler.profiler to 'torch' or 'cuda' "
                "(and profiler.output_dir) in the worker config"
            )
        if kind == "cuda":
            if self.ops.name != "cuda":
                raise RuntimeError("profiler.profiler='cuda' needs a CUDA device")
            (torch.cuda.profiler.start if is_start else torch.cuda.profiler.stop)()
            return
        if is_start:
            if self._profiler is not None:
                raise RuntimeError("the torch profiler is already running")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.ops.name == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            return
        if self._profiler is None:
            raise RuntimeError("the torch profiler is not running: call profile(True) first")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        out = Path(self.config.profiler.output_dir or ".")
        out.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(out / f"rank{self.rank}-{time.time_ns()}.trace.json"))

    def sleep(self, level: int = 1) -> None:
        runner = self._runner()
        if self.kv_connector is not None and (staged := self.kv_connector.num_cache_readers):
            raise RuntimeError(
                f"sleep with the KV of {staged} request(s) staged for transfer out of the "
                "cache it would release: let them be pulled (or expire) first"
            )
        self._sleep.sleep(runner, level)
        if level == 2:
            self._transfer().weights_released()
        self.ops.release_workspaces()
        self.ops.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        runner = self._runner()
        self._sleep.wake_up(runner, tags, self.device, self._kv_cache_config)
        if not self._sleep.asleep:
            # Sleep dropped the graphs with the memory they were captured over.
            runner.capture_graphs()

    def check_health(self) -> None:
        started = self._step_started
        if started is not None and time.monotonic() - started > STEP_WEDGED_AFTER_S:
            raise RuntimeError(
                f"rank {self.rank}: a step has run for {time.monotonic() - started:.0f} s"
            )
        if self.device is None:
            return
        result: list[float] = []
        probe = threading.Thread(target=lambda: result.append(self._device_probe()), daemon=True)
        probe.start()
        probe.join(HEALTH_OP_TIMEOUT_S)
        if result != [2.0]:
            raise RuntimeError(
                f"rank {self.rank}: device {self.device} did not answer a probe within "
                f"{HEALTH_OP_TIMEOUT_S} s"
            )

    # weights ------------------------------------------------------------------------

    def start_weight_update(self, update: WeightUpdate) -> None:
        self._weights_in_place("start_weight_update").start(update)

    def load_weight_chunk(self, chunk: SharedWeights | CudaWeights) -> None:
        self._weights_in_place("load_weight_chunk").load_chunk(chunk)

    def finish_weight_update(self) -> None:
        self._transfer().finish()

    def abort_weight_update(self) -> None:
        self._transfer().abort()

    def init_weight_transfer_group(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float = 300.0
    ) -> None:
        rank = rank_offset + self.rank
        self._transfer().init_group(host, port, world_size, rank, timeout_s)

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        self._weights_in_place("update_weights_from_group").receive_from_group(update)

    def reload_weights(self, path: str | None = None) -> None:
        self._weights_in_place("reload_weights").reload(path)

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        # The seed's order: KV transfer first, then weight transfer, then the rest.
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
        if self.weight_transfer is not None:
            self.weight_transfer.shutdown()
            self.weight_transfer = None
        if self.model_runner is not None:
            self.model_runner.shutdown()
            self.model_runner = None
        self._sleep.clear()
        if self.state is not None:
            destroy_parallel_state()
            self.state = None
        self.ops.empty_cache()

    # helpers --------------------------------------------------------------------------

    def _runner(self) -> ModelRunner:
        if self._shut_down:
            raise RuntimeError(f"rank {self.rank} is shut down")
        if self.model_runner is None:
            step = "init_device" if self.state is None else "load_model"
            raise RuntimeError(f"{step} has not run: call it first")
        return self.model_runner

    def _transfer(self) -> WeightTransferEngine:
        self._runner()  # says which start-up call is missing
        assert self.weight_transfer is not None
        return self.weight_transfer

    def _weights_in_place(self, what: str) -> WeightTransferEngine:
        """The weight-transfer engine, once the weights have device memory."""
        transfer = self._transfer()
        if self._sleep.weights_released:
            raise RuntimeError(
                f"{what} while the weights are released by sleep ({self._sleep.describe()}): "
                "call wake_up(['weights']) first"
            )
        return transfer

    def _require_awake(self, what: str) -> None:
        if self._sleep.asleep:
            raise RuntimeError(f"{what} while asleep ({self._sleep.describe()}): call wake_up")
        not_ready = self.weight_transfer.not_ready if self.weight_transfer else None
        if not_ready is not None:
            raise RuntimeError(f"{what}: {not_ready}")

    def _device_probe(self) -> float:
        with self.ops.on(self.device):  # the probe's own thread
            x = torch.ones(1, device=self.device) + 1
            self.ops.synchronize()
            return float(x.item())


def _weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as a thread count (Ray sets it to an actor's CPUs), set explicitly:
    torch reads it only as it starts, before the Welcome's env has arrived."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _num_kv_heads(hf_config: Any) -> int:
    """The model's key/value heads, all ranks' (attention heads where it does not say)."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
