"""A worker without a model, for measuring and testing the transport alone.

EchoWorker answers every WorkerBase call at once with a well-formed result: its
execute_model returns a ModelRunnerOutput for the step's requests (token = handle + 1),
so a step's round trip costs exactly the messages and nothing else. EchoExtension adds
methods that tests use to provoke the executor's failure paths.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np

from messages import (
    CudaWeights,
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    SharedWeights,
    WeightUpdate,
)
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.worker.worker_base import WorkerBase, freeze_startup_heap

FAKE_KV_BYTES = 1 << 30


class EchoWorker(WorkerBase):
    def init_device(self) -> None:
        self.initialized = True

    def load_model(self) -> None:
        self.loaded = True

    def determine_available_memory(self) -> int:
        return FAKE_KV_BYTES

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(16, 1, 8, "float32", [f"layer.{self.rank}"])

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def compile_or_warm_up_model(self) -> float:
        freeze_startup_heap()
        return 0.0

    def execute_model(
        self, scheduler_output: SchedulerOutput, sample: bool = True, *, call_id: int = 0
    ) -> ModelRunnerOutput:
        handles = np.concatenate(
            [
                np.array([r.req_handle for r in scheduler_output.scheduled_new_reqs], np.int32),
                scheduler_output.scheduled_cached_reqs.req_handles,
            ]
        )
        return ModelRunnerOutput(req_handles=handles, sampled_token_ids=handles + 1)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        handles = np.zeros(0, np.int32) if grammar_output is None else grammar_output.req_handles
        return ModelRunnerOutput(req_handles=handles, sampled_token_ids=handles + 1)

    def profile(self, is_start: bool = True) -> None:
        raise RuntimeError("EchoWorker has no profiler")

    def sleep(self, level: int = 1) -> None:
        self.asleep = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep = 0

    def start_weight_update(self, update: WeightUpdate) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def load_weight_chunk(self, chunk: SharedWeights | CudaWeights) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def finish_weight_update(self) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def abort_weight_update(self) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def init_weight_transfer_group(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float = 300.0
    ) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def reload_weights(self, path: str | None = None) -> None:
        raise RuntimeError("EchoWorker has no weights")

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.initialized = False


class EchoExtension:
    """Extra RPC methods for tests and benchmarks."""

    def noop(self) -> None:
        return None

    def echo(self, value: object) -> object:
        return value

    def log_call(self, value: int) -> list[int]:
        """Note value in this worker's call log; the log so far, in the order run."""
        self.call_log = [*getattr(self, "call_log", []), value]
        return self.call_log

    def sleep_for(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def unencodable(self) -> object:
        return object()  # not a declared message type

    def mapping(self) -> object:
        return {"tokens": 3}  # encodes, but no Value: the engine could not decode it

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def frozen_objects(self) -> int:
        """How many objects this process has moved out of the collector's sight."""
        return gc.get_freeze_count()

    def late_output(self, handles: list[int], delay_s: float, fail: str = "") -> object:
        """A step's output whose ids land on the host delay_s later, as a CUDA step's
        copy does (token = handle + 1), or whose wait then fails with `fail`."""
        ids = np.array(handles, np.int32) + 1
        return AsyncModelRunnerOutput(
            np.array(handles, np.int32), None, _HostIds(ids), event=_LateCopy(delay_s, fail)
        )

    def fail_on_rank(self, rank: int) -> int:
        if self.rank == rank:
            raise RuntimeError(f"failing on purpose on rank {rank}")
        return self.rank


class _HostIds:
    """Sampled ids as the output holds them (a host tensor, here without torch)."""

    def __init__(self, ids: np.ndarray) -> None:
        self._ids = ids

    def numpy(self) -> np.ndarray:
        return self._ids


class _LateCopy:
    """A device-to-host copy's event that completes delay_s after it is made."""

    def __init__(self, delay_s: float, fail: str) -> None:
        self._done = threading.Event()
        self._fail = fail
        timer = threading.Timer(delay_s, self._done.set)
        timer.daemon = True  # a worker that exits first does not wait for it
        timer.start()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._fail:
            raise RuntimeError(self._fail)
