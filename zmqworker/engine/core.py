"""EngineCore: drives the workers' start-up, then runs steps through the batch queue."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from messages import (
    EngineCoreStats,
    KVCacheSpec,
    KVTransferConfig,
    SchedulerConfig,
    make_kv_cache_config,
)
from zmqworker.engine.batch_queue import BatchQueue
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.grammar_steps import GrammarSteps
from zmqworker.engine.host_tier import make_host_tier
from zmqworker.engine.kv_connector import KVConnectorScheduler
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.scheduler import Scheduler
from zmqworker.engine.structured_outputs import StructuredOutputs
from zmqworker.engine.weight_calls import WeightCalls, refusals
from zmqworker.executor.errors import WORKERS_LOST

if TYPE_CHECKING:
    from zmqworker.executor.abstract import Executor

logger = logging.getLogger(__name__)

# Steps in flight with async scheduling. Two hide the engine only while a GPU step outlasts
# its whole turn (output back, update, schedule, send) and the worker's preparation, which a
# small model's large batch does not (docs/cuda.md, serving); three give the turn two steps.
ASYNC_STEPS_IN_FLIGHT = 3
# The longest step() waits for a grammar when nothing else is left to run.
GRAMMAR_WAIT_S = 0.005


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

    Between steps (sleep, wake_up, weight updates, the prefix cache, any worker method):
    each waits for the steps in flight first (drain), so that it never lands mid-step.
    The engine keeps what it asked for (released; weights.released) and what a weight
    change that failed part-way left (weights: weight_calls.py) to refuse a step before
    sending it; the workers refuse one too.

    Structured outputs (structured, given a GrammarCompiler's StructuredOutputs): a
    request waits there for its grammar, then goes to the scheduler. A step that samples
    for requests with a grammar is sent as its forward, then sample_tokens with their
    bitmask (grammar_steps.py): the bitmask fills while step() returns the outputs of
    the steps taken back for it, and the next step() (or drain) sends it first. A step
    without such requests goes as one call, as before.
    """

    def __init__(
        self,
        executor: Executor,
        max_model_len: int,
        scheduler_config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = False,
        async_scheduling: bool = False,
        async_steps_in_flight: int = ASYNC_STEPS_IN_FLIGHT,
        kv_transfer: KVTransferConfig | None = None,
        structured: StructuredOutputs | None = None,
        kv_offloading_size: float = 0.0,
    ) -> None:
        """kv_transfer: the workers' KV transfer config (WorkerConfig.kv_transfer), for
        their connector's scheduler side (None: none); kv_offloading_size: host tier GiB."""
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
        self.block_manager = KVBlockManager(
            num_blocks, specs[0].block_size, enable_prefix_caching,
            make_host_tier(kv_offloading_size, specs),
        )  # fmt: skip
        stages = executor.max_concurrent_batches
        self.async_scheduling = async_scheduling and stages == 1
        depth = async_steps_in_flight if self.async_scheduling else stages
        self.kv_connector: KVConnectorScheduler | None = None
        if kv_transfer is not None:
            self.kv_connector = KVConnectorScheduler.of(
                kv_transfer, self.block_manager, executor.world_size, stages
            )
        # Pipeline stages before the last do not sample: they get the tokens in the deltas.
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            send_token_ids=stages > 1,
            max_concurrent_batches=depth,
            async_scheduling=self.async_scheduling,
            kv_connector=self.kv_connector,
        )
        self.batch_queue = BatchQueue(
            lambda output: executor.execute_model(output, non_block=depth > 1), depth
        )
        started = time.perf_counter()
        num_slots = self.block_manager.num_host_blocks
        executor.initialize_from_config(make_kv_cache_config(specs, num_blocks, num_slots))
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
        self.structured = structured
        self.grammar_steps = GrammarSteps(executor, self.scheduler, self.batch_queue, structured)
        # Requests whose grammar failed to compile, with why, for the caller to report.
        self.failed: list[tuple[Request, str]] = []
        self.num_aborted = 0  # requests aborted by their clients, since start
        self.released: set[str] = set()  # what sleep gave back and wake_up has not
        self.weights = WeightCalls(executor, self.block_manager, self.drain)

    def add_request(self, request: Request) -> None:
        if self.structured is not None and request.req_id in self.structured:
            raise ValueError(f"request id {request.req_id!r} is already waiting for its grammar")
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        if self.structured is None:
            raise ValueError(
                f"request {request.req_id!r}: this engine core takes no structured_outputs"
            )
        self.scheduler.check_request(request)
        self.structured.add(request)

    def abort_request(self, req_id: str, counted: bool = True) -> Request | None:
        """Abort req_id; the aborted request, or None if it was unknown or finished. A
        finished prefill whose KV waits for a decode instance has it withdrawn (its blocks
        go). counted: its client gave up on it (num_aborted), rather than stopping it."""
        request = self.structured.abort(req_id) if self.structured else None
        if request is not None:
            request.finish(FinishReason.ABORT)
        else:
            request = self.scheduler.abort_request(req_id)
        if request is None and self.kv_connector is not None:
            self.kv_connector.withdraw(req_id)
        if request is not None and counted:
            self.num_aborted += 1
        return request

    def holds_kv(self, req_id: str) -> bool:
        """Whether blocks are still held under req_id (a finished prefill's, for a pull)."""
        return self.kv_connector is not None and self.kv_connector.holds(req_id)

    @property
    def num_unfinished(self) -> int:
        """Requests not finished: in the scheduler, or waiting for their grammar."""
        return self.scheduler.num_unfinished + (len(self.structured) if self.structured else 0)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: in the queue, for their grammar, or for their prompt's
        KV from a prefill instance (a decode instance's, which a router balances by)."""
        pulls = self.kv_connector.num_pulls if self.kv_connector is not None else 0
        structured = len(self.structured) if self.structured else 0
        return len(self.scheduler.waiting) + structured + pulls

    @property
    def load(self) -> int:
        """Running and waiting requests, what clients balance by (the stats' num_running
        and num_waiting), without building the stats."""
        return len(self.scheduler.running) + self.num_waiting

    def has_work(self) -> bool:
        """Whether step() has anything to do: unfinished requests (or KV transfers whose
        end steps must hear of) or steps in flight."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.structured and len(self.structured))
            or len(self.batch_queue) > 0
        )

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests whose grammar failed since the last call, with why (finished)."""
        failed, self.failed = self.failed, []
        return failed

    def not_ready(self) -> str | None:
        """Why no step can run now (asleep, weights dropped by sleep(2), or left part-way
        by an update or reload that failed); None if one can."""
        if self.released:
            return f"asleep ({', '.join(sorted(self.released))} released): call wake_up()"
        return self.weights.not_ready()

    def step(self) -> list[Request]:
        """One turn of the loop: schedule a step if the queue has room, and consume the
        oldest step's output once the queue is full or nothing more can be scheduled.
        Returns the requests that got a token or finished (possibly none)."""
        why_not = self.not_ready()
        if why_not is not None:
            raise RuntimeError(f"no step: {why_not}")
        if self.structured is not None and len(self.structured):
            self._admit_compiled()
        try:
            changed = self.grammar_steps.send()
            if not self.batch_queue.full:
                output = self.scheduler.schedule()
                if output is not None:
                    structured = self.scheduler.structured_requests(output)
                    if structured:
                        changed += self.grammar_steps.submit(output, structured)
                    else:
                        self.batch_queue.submit(output)
                    if not self.batch_queue.full:
                        return changed  # room for another step before waiting on this one
            if len(self.batch_queue) == 0:
                return changed
            if len(self.batch_queue) == 1:  # the step to wait for may be the unsent one
                changed += self.grammar_steps.send()
            output, runner_output = self.batch_queue.pop()
            return changed + self.scheduler.update_from_output(output, runner_output)
        except Exception as e:
            self._recover(e)
            raise

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready into the scheduler; those whose grammar failed
        finished, into failed. With nothing else to run, wait a little for one."""
        assert self.structured is not None
        idle = not self.scheduler.num_unfinished and not len(self.batch_queue)
        ready, failed = self.structured.take_ready(GRAMMAR_WAIT_S if idle else 0.0)
        for request in ready:
            self.scheduler.add_request(request)
        for request, _ in failed:
            request.finish(FinishReason.ABORT)
        self.failed += failed

    def stats(self) -> EngineCoreStats:
        """Requests and KV cache blocks now."""
        kv = self.block_manager
        tier, connector = kv.host_tier, self.kv_connector
        return EngineCoreStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.num_waiting,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_aborted=self.num_aborted,
            num_prefill_tokens=self.scheduler.num_prefill_tokens,
            num_host_blocks=tier.num_slots if tier else 0,
            num_host_blocks_used=len(tier) if tier else 0,
            num_host_stored_blocks=tier.num_stored if tier else 0,
            num_host_loaded_blocks=tier.num_loaded if tier else 0,
            num_host_dropped_blocks=tier.num_dropped if tier else 0,
            num_remote_hit_blocks=connector.num_hit_blocks if connector else 0,
            num_remote_pulled_blocks=connector.num_pulled_blocks if connector else 0,
        )

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise if a worker does not answer within timeout (they answer beside steps)."""
        self.executor.check_health(timeout=timeout)

    def _recover(self, error: Exception) -> None:
        """After a step failed with error: wait out the steps still in flight (the workers
        run them anyway), then abort every request, so the engine can take new ones."""
        try:
            self.grammar_steps.send()  # the newest step's sampling, if still unsent
        except Exception:
            logger.debug("the newest step's bitmask failed too", exc_info=True)
        self.grammar_steps.end_unsent()
        while len(self.batch_queue):
            try:
                self.batch_queue.pop()
            except Exception:
                logger.debug("a step in flight failed too", exc_info=True)
        # The workers report anew what the next step's cancels leave of the transfers.
        self.executor.forget_transfer_reports()
        # A worker that died, is stuck or wedged in a step reads nothing of its cache any more.
        workers_lost = isinstance(error, WORKERS_LOST)
        aborted = self.scheduler.reset_after_failure(workers_lost)
        aborted += self.structured.abort_all() if self.structured else []  # failed at clients
        self.block_manager.reset_prefix_cache()  # the step may have left blocks half written
        logger.warning("a step failed: %d requests aborted", len(aborted))

    # -- between steps ----------------------------------------------------------------

    def drain(self) -> list[Request]:
        """Wait for the steps in flight and apply their outputs; the requests that got a
        token or finished. The workers are idle when it returns."""
        changed: list[Request] = []
        try:
            changed += self.grammar_steps.send()
            while len(self.batch_queue):
                output, runner_output = self.batch_queue.pop()
                changed += self.scheduler.update_from_output(output, runner_output)
        except Exception as e:
            self._recover(e)
            raise
        return changed

    def sleep(self, level: int) -> None:
        self.drain()
        unfinished = self.num_unfinished
        if unfinished:
            raise RuntimeError(
                f"sleep with {unfinished} request(s) unfinished, whose KV cache it would drop: "
                "let them finish or abort them first"
            )
        transfers = self.kv_connector.under_way() if self.kv_connector is not None else None
        if transfers:
            raise RuntimeError(
                f"sleep with {transfers}, whose blocks it would drop: step until the "
                "transfers end (pulled, or expired) first"
            )
        with refusals():
            self.executor.sleep(level)
        self.block_manager.reset_prefix_cache()  # the cache's contents are gone
        self.released = {"weights", "kv_cache"}
        self.weights.released = self.weights.released or level == 2

    def wake_up(self, tags: list[str] | None) -> None:
        self.drain()
        with refusals():
            self.executor.wake_up(tags)
        self.released -= {"weights", "kv_cache"} if tags is None else set(tags)

    def reset_prefix_cache(self) -> None:
        self.drain()
        self.block_manager.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """A worker method on every rank, between steps (timeout None: the call bound)."""
        self.drain()
        bound = self.executor.call_timeout_s if timeout is None else timeout
        run = functools.partial(self.executor.collective_rpc, method, args, kwargs, bound)
        return self.weights.worker_call(method, args, run)

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()
