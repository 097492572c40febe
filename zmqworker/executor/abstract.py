"""The engine-side interface of a set of workers, whatever runs them."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from messages import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    WorkerConfig,
)
from zmqworker.executor.stage_reports import CombinedFuture, StageReports

if TYPE_CHECKING:
    from zmqworker.executor.errors import ExecutorError

STEP_TIMEOUT_S = 300.0  # vLLM's default bound on a step, too
CALL_TIMEOUT_S = 3600.0  # memory profiling, KV cache set-up, warm-up (compiling) included


class Executor(ABC):
    config: WorkerConfig
    # Bounds on the calls of the methods below, which engines make without a timeout of
    # their own: a live worker that never answers then fails the call with
    # RpcTimeoutError rather than holding the engine for ever (a dead worker fails it at
    # once, whatever the bound). None: no bound. Settable per executor.
    step_timeout_s: float | None = STEP_TIMEOUT_S  # execute_model, sample_tokens
    call_timeout_s: float | None = CALL_TIMEOUT_S  # the others, but check_health

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | list[int] | None = None,
        non_block: bool = False,
    ) -> Any:
        """Call method on every worker. Returns the list of results by rank, or only
        unique_reply_rank's result (a list of ranks: theirs, in rank order), or with
        non_block a Future of either."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release every resource; safe to call twice."""

    @property
    def failure(self) -> ExecutorError | None:
        """Why the workers serve no more (one died), found with no call open: an idle
        engine learns it without a step. None while they serve, or where it is unknown."""
        return None

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose reply carries a step's output: first TP rank of the last stage."""
        p = self.config.parallel
        return (p.pipeline_parallel_size - 1) * p.tensor_parallel_size

    @functools.cached_property
    def stage_reports(self) -> StageReports | None:
        """Where the stages' KV transfer reports are combined: KV transfer over pipeline
        stages only (stage_reports.py); None: the output rank's reply has them all."""
        p = self.config.parallel
        if self.config.kv_transfer is None or p.pipeline_parallel_size == 1:
            return None
        return StageReports(p.pipeline_parallel_size, p.tensor_parallel_size)

    def forget_transfer_reports(self) -> None:
        """After a failed step, once every step in flight has been waited for: drop what
        the stages reported of KV transfers and no output carried yet. The engine's
        next step cancels every load and withdraws every save, which the workers then
        report anew (stage_reports.py)."""
        if self.stage_reports is not None:
            self.stage_reports.reset()

    def execute_model(
        self, scheduler_output: SchedulerOutput, sample: bool = True, non_block: bool = False
    ) -> Any:
        """The step's ModelRunnerOutput (None when sample is False), or a Future of it."""
        stages = self.stage_reports
        result = self.collective_rpc(
            "execute_model",
            (scheduler_output,),
            {"sample": sample},
            timeout=self.step_timeout_s,
            unique_reply_rank=self.output_rank if stages is None else stages.ranks,
            non_block=non_block,
        )
        if stages is None:
            return result
        combine = functools.partial(stages.forward_output, scheduler_output)
        return CombinedFuture(result, combine) if non_block else combine(result)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None, non_block: bool = False
    ) -> Any:
        result = self.collective_rpc(
            "sample_tokens",
            (grammar_output,),
            timeout=self.step_timeout_s,
            unique_reply_rank=self.output_rank,
            non_block=non_block,
        )
        stages = self.stage_reports
        if stages is None:
            return result
        return (
            CombinedFuture(result, stages.sample_output)
            if non_block
            else stages.sample_output(result)
        )

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory", timeout=self.call_timeout_s)

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return self.collective_rpc("get_kv_cache_spec", timeout=self.call_timeout_s)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc(
            "initialize_from_config", (kv_cache_config,), timeout=self.call_timeout_s
        )

    def compile_or_warm_up_model(self) -> list[float]:
        return self.collective_rpc("compile_or_warm_up_model", timeout=self.call_timeout_s)

    def profile(self, is_start: bool = True) -> None:
        self.collective_rpc("profile", (is_start,), timeout=self.call_timeout_s)

    def sleep(self, level: int = 1) -> None:
        self.collective_rpc("sleep", (level,), timeout=self.call_timeout_s)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.collective_rpc("wake_up", (tags,), timeout=self.call_timeout_s)

    def check_health(self, timeout: float = 30.0) -> None:
        self.collective_rpc("check_health", timeout=timeout)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
