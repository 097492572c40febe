"""The KV transfer reports of pipeline stages, combined on the engine's side.

Each stage holds its own layers' KV and moves it on its own, but only the last stage's
reply carries a step's output. So with KV transfer over pipeline stages a step's call is
answered by the first rank of every stage, with its stage's reports (combined over the
stage's tp ranks by kv_transfer/tp_reports.py), and a transfer reaches the scheduler once
every stage has reported it; a failed load as soon as any stage has failed it. A
collective across the stages would combine them on the workers' side, but it would hold
every stage in a step until the last stage reached it, and a step that computes nothing
moves no tensors between stages, while it may be the one that hears of a transfer.

The reports are taken in the order the engine consumes the steps, which is the order the
workers ran them: a step's cancels apply before its reports, as on the workers (a
cancelled load is reported by no stage after that).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from messages import ModelRunnerOutput, SchedulerOutput
from messages.kv_transfer import KVConnectorOutput, KVFailure


class StageReports:
    def __init__(self, num_stages: int, tp_size: int) -> None:
        self.num_stages = num_stages
        # The rank answering for each stage: its first; the last is the output rank.
        self.ranks = [stage * tp_size for stage in range(num_stages)]
        # Transfers reported by some stages, not all yet: the stages that did.
        self._sent: dict[str, set[int]] = {}
        self._recved: dict[str, set[int]] = {}
        # Failed loads already reported to the scheduler: the stages heard from since,
        # each of which reports the load once (done or failed), so the id is forgotten
        # once all have, and a later load under that id starts afresh.
        self._failed: dict[str, set[int]] = {}
        self._ready = KVConnectorOutput()  # for the next output the engine gets

    def reset(self) -> None:
        """Forget every report (after a failed step: forget_transfer_reports)."""
        self._sent.clear()
        self._recved.clear()
        self._failed.clear()
        self._ready = KVConnectorOutput()

    def forward_output(
        self, scheduler_output: SchedulerOutput, results: list[Any]
    ) -> ModelRunnerOutput | None:
        """execute_model's output out of the stages' replies (ranks' results): the last
        stage's ModelRunnerOutput (None with sample=False), carrying every transfer that
        all stages have reported by now."""
        if len(results) != self.num_stages:
            raise RuntimeError(f"{len(results)} stage replies to a step of {self.num_stages}")
        metadata = scheduler_output.kv_connector_metadata
        for req_id in [] if metadata is None else metadata.cancel_loads:
            self._recved.pop(req_id, None)
            self._failed.pop(req_id, None)
        *reports, output = results
        for stage, report in enumerate(reports):
            if report is not None and not isinstance(report, KVConnectorOutput):
                raise RuntimeError(f"stage {stage} replied {type(report).__name__} to a step")
            self._take(stage, report)
        return self.sample_output(output)

    def sample_output(self, output: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        """The last stage's output with the reports of every stage in it (its own taken
        first); None: the step is not sampled yet, and what is ready waits for it."""
        if output is None:
            return None
        if not isinstance(output, ModelRunnerOutput):
            raise RuntimeError(f"the last stage replied {type(output).__name__} to a step")
        self._take(self.num_stages - 1, output.kv_connector_output)
        ready, self._ready = self._ready, KVConnectorOutput()
        output.kv_connector_output = ready if ready else None
        return output

    def _take(self, stage: int, report: KVConnectorOutput | None) -> None:
        if report is None:
            return
        ready = self._ready
        ready.finished_sending += [
            r for r in report.finished_sending if self._all(self._sent, r, stage)
        ]
        for failure in report.failed_recving:
            if failure.req_id in self._failed:
                self._closing(failure.req_id, stage)
                continue
            heard = self._recved.pop(failure.req_id, set())
            self._failed[failure.req_id] = heard
            self._closing(failure.req_id, stage)
            ready.failed_recving.append(
                KVFailure(failure.req_id, f"pipeline stage {stage}: {failure.error}")
            )
        for req_id in report.finished_recving:
            if req_id in self._failed:
                self._closing(req_id, stage)
            elif self._all(self._recved, req_id, stage):
                ready.finished_recving.append(req_id)

    def _all(self, reported: dict[str, set[int]], req_id: str, stage: int) -> bool:
        """Note that stage reported req_id; True (and forgotten) once every stage has."""
        stages = reported.setdefault(req_id, set())
        stages.add(stage)
        if len(stages) < self.num_stages:
            return False
        del reported[req_id]
        return True

    def _closing(self, req_id: str, stage: int) -> None:
        self._all(self._failed, req_id, stage)


class CombinedFuture(Future):
    """A step's future whose result is combine(the call's result), computed once, when
    the engine first takes it (so in the order it takes the steps): done() may be True
    before then, and it takes no callbacks."""

    def __init__(self, call: Future, combine: Callable[[Any], Any]) -> None:
        super().__init__()
        self._call = call
        self._combine = combine

    def result(self, timeout: float | None = None) -> Any:
        if not super().done():
            try:
                value = self._call.result(timeout)
            except BaseException as e:
                if not self._call.done():  # only the wait timed out: the call goes on
                    raise
                self.set_exception(e)
                raise
            try:
                self.set_result(self._combine(value))
            except BaseException as e:
                self.set_exception(e)
                raise
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:
            if not super().done():
                raise
            return e
        return None

    def done(self) -> bool:
        return super().done() or self._call.done()

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Future], object]) -> None:
        raise TypeError(
            "a step's combined future is taken with result(), in the order of the steps: "
            "a callback would combine its reports out of that order"
        )
