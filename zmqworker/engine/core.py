"""EngineCore: drives the workers' start-up, then runs steps through the batch queue."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from messages import (
    EngineCoreStats,
    KVCacheSpec,
    SchedulerConfig,
    WorkerCall,
    make_kv_cache_config,
)
from zmqworker.engine.batch_queue import BatchQueue
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.request import Request
from zmqworker.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from zmqworker.executor.abstract import Executor

logger = logging.getLogger(__name__)

# Steps in flight with async scheduling. Two hide the engine only while one GPU step
# outlasts the engine's whole turn (output back, update, schedule, send) plus the
# worker's preparation: for a small model at 256 requests on an H200 that turn is about
# 2.2 ms against a 1.7 ms step. With three, the turn has two steps to fit in.
ASYNC_STEPS_IN_FLIGHT = 3


def num_blocks_from_memory(available_bytes: list[int], specs: list[KVCacheSpec]) -> int:
    """The KV cache blocks every rank can hold: the minimum over ranks of its bytes over a
    block's bytes in all of its layers (page_size_bytes is per layer)."""
    if len(available_bytes) != len(specs):
        raise ValueError(
            f"{len(available_bytes)} ranks reported memory but {len(specs)} reported KV specs"
        )
    if not specs:
        raise ValueError("no ranks reported KV cache memory")
    counts = []
    for rank, (available, spec) in enumerate(zip(available_bytes, specs, strict=True)):
        if not spec.layer_names:
            raise ValueError(f"rank {rank} reported no attention layers")
        block_bytes = spec.page_size_bytes * len(spec.layer_names)
        if available < block_bytes:
            raise ValueError(
                f"rank {rank} has {available} bytes for the KV cache, less than one block "
                f"({block_bytes} bytes)"
            )
        counts.append(available // block_bytes)
    return min(counts)


class EngineCore:
    """The engine loop over an Executor: scheduler, KV block manager and batch queue.

    Construction runs the start-up the workers expect after load_model:
    determine_available_memory -> (num_blocks) -> initialize_from_config ->
    compile_or_warm_up_model. Not thread-safe: one thread calls step() and the rest.

    Steps in flight: one per pipeline stage; with one stage and async_scheduling,
    async_steps_in_flight, each going on from the one before, so that the workers never
    wait for the engine.
    """

    def __init__(
        self,
        executor: Executor,
        max_model_len: int,
        scheduler_config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = False,
        async_scheduling: bool = False,
        async_steps_in_flight: int = ASYNC_STEPS_IN_FLIGHT,
    ) -> None:
        if async_steps_in_flight < 2:
            raise ValueError(f"async_steps_in_flight must be >= 2, got {async_steps_in_flight}")
        config = scheduler_config or SchedulerConfig()
        self.executor = executor
        self.max_model_len = max_model_len
        started = time.perf_counter()
        available = executor.determine_available_memory()
        specs = executor.get_kv_cache_specs()
        num_blocks = num_blocks_from_memory(available, specs)
        logger.info("memory profile: %.1f s", time.perf_counter() - started)
        self.block_manager = KVBlockManager(num_blocks, specs[0].block_size, enable_prefix_caching)
        stages = executor.max_concurrent_batches
        self.async_scheduling = async_scheduling and stages == 1
        depth = async_steps_in_flight if self.async_scheduling else stages
        # Pipeline stages before the last do not sample: they get the tokens in the deltas.
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            send_token_ids=stages > 1,
            max_concurrent_batches=depth,
            async_scheduling=self.async_scheduling,
        )
        self.batch_queue = BatchQueue(
            lambda output: executor.execute_model(output, non_block=depth > 1),
            depth,
            continue_in_flight=self.async_scheduling,
        )
        started = time.perf_counter()
        executor.initialize_from_config(make_kv_cache_config(specs, num_blocks))
        logger.info(
            "KV cache: %d blocks of %d tokens = %.1f MiB per worker: %.1f s",
            num_blocks,
            specs[0].block_size,
            num_blocks * max(s.page_size_bytes * len(s.layer_names) for s in specs) / (1 << 20),
            time.perf_counter() - started,
        )
        started = time.perf_counter()
        executor.compile_or_warm_up_model()
        logger.info("warm-up: %.1f s", time.perf_counter() - started)
        self.num_aborted = 0  # requests aborted by their clients, since start

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, req_id: str, counted: bool = True) -> Request | None:
        """Abort req_id; the aborted request, or None if it was unknown or finished.
        counted: its client gave up on it (num_aborted), rather than stopping it."""
        request = self.scheduler.abort_request(req_id)
        if request is not None and counted:
            self.num_aborted += 1
        return request

    def has_work(self) -> bool:
        """Whether step() has anything to do: unfinished requests or steps in flight."""
        return self.scheduler.has_unfinished_requests() or len(self.batch_queue) > 0

    def step(self) -> list[Request]:
        """One turn of the loop: schedule a step if the queue has room, and consume the
        oldest step's output once the queue is full or nothing more can be scheduled.
        Returns the requests that got a token or finished (possibly none)."""
        try:
            if not self.batch_queue.full:
                output = self.scheduler.schedule()
                if output is not None:
                    self.batch_queue.submit(output)
                    if not self.batch_queue.full:
                        return []  # room for another step before waiting on this one
            if len(self.batch_queue) == 0:
                return []
            output, runner_output = self.batch_queue.pop()
            return self.scheduler.update_from_output(output, runner_output)
        except Exception:
            self._recover()
            raise

    def finish_steps_in_flight(self) -> list[Request]:
        """Wait for every step in flight and apply it, scheduling nothing new (before a
        call that must not land mid-step); the requests that got a token or finished."""
        changed: list[Request] = []
        try:
            while len(self.batch_queue):
                changed += self.scheduler.update_from_output(*self.batch_queue.pop())
        except Exception:
            self._recover()
            raise
        return changed

    def stats(self) -> EngineCoreStats:
        """Requests and KV cache blocks now."""
        kv = self.block_manager
        return EngineCoreStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_aborted=self.num_aborted,
        )

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise if a worker does not answer within timeout (they answer beside steps)."""
        self.executor.check_health(timeout=timeout)

    def collective_rpc(self, call: WorkerCall) -> list:
        """A worker method on every rank, between steps (the steps in flight first): the
        results by rank."""
        return self.executor.collective_rpc(
            call.method, tuple(call.args), call.kwargs, timeout=call.timeout
        )

    def _recover(self) -> None:
        """After a failed step: wait out the steps still in flight (the workers run them
        anyway), then abort every request, so the engine can take new ones."""
        while len(self.batch_queue):
            try:
                self.batch_queue.pop()
            except Exception:
                logger.debug("a step in flight failed too", exc_info=True)
        aborted = self.scheduler.reset_after_failure()
        logger.warning("a step failed: %d requests aborted", len(aborted))

    def shutdown(self) -> None:
        self.executor.shutdown()
