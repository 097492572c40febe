"""The pipeline stages' KV transfer reports, combined on the engine's side
(executor/stage_reports.py): a transfer reaches the scheduler once every stage has
reported it, in whichever steps they did; a failed load at once, and the other stages'
word on it later is dropped; a step's cancels drop what the stages reported of a load
before; with sample=False the forward's reports wait for the step's sampled output;
after a failed step nothing reported before is counted.
And the future a step's call gives when it does not block."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest

from messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVFailure
from zmqworker.executor.stage_reports import CombinedFuture, StageReports


def step(cancel_loads: list[str] | None = None) -> SchedulerOutput:
    metadata = KVConnectorMetadata(cancel_loads=cancel_loads) if cancel_loads else None
    return SchedulerOutput([], CachedRequestData.empty(), 0, kv_connector_metadata=metadata)


def output(report: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    empty = np.zeros(0, np.int32)
    return ModelRunnerOutput(empty, empty, kv_connector_output=report)


def got(out: ModelRunnerOutput | None) -> tuple[list[str], list[str], list[str]]:
    assert out is not None
    report = out.kv_connector_output or KVConnectorOutput()
    failed = [f.req_id for f in report.failed_recving]
    return report.finished_sending, report.finished_recving, failed


def test_a_transfer_is_reported_once_every_stage_has_in_any_step() -> None:
    stages = StageReports(3, tp_size=2)
    assert stages.ranks == [0, 2, 4]  # each stage's first rank; the last is the output rank
    first = stages.forward_output(
        step(), [KVConnectorOutput(["s"], ["a"]), None, output(KVConnectorOutput([], ["b"]))]
    )
    assert got(first) == ([], [], [])
    second = stages.forward_output(
        step(),
        [KVConnectorOutput([], ["b"]), KVConnectorOutput(["s"], ["a", "b"]), output()],
    )
    assert got(second) == ([], ["b"], [])
    third = stages.forward_output(step(), [None, None, output(KVConnectorOutput(["s"], ["a"]))])
    assert got(third) == (["s"], ["a"], [])
    assert got(stages.forward_output(step(), [None, None, output()])) == ([], [], [])


def test_a_failure_is_reported_at_once_and_the_other_stages_word_on_it_dropped() -> None:
    stages = StageReports(2, tp_size=1)
    done_first = KVConnectorOutput([], ["x"])
    out = stages.forward_output(step(), [done_first, output()])
    assert got(out) == ([], [], [])
    failed = KVConnectorOutput(failed_recving=[KVFailure("x", "no answer from tcp://h:1")])
    out = stages.forward_output(step(), [None, output(failed)])
    assert out is not None and out.kv_connector_output is not None
    [failure] = out.kv_connector_output.failed_recving
    assert failure.req_id == "x" and failure.error == "pipeline stage 1: no answer from tcp://h:1"
    # Both stages have had their word on "x": a later load under that id starts afresh.
    again = stages.forward_output(step(), [KVConnectorOutput([], ["x"]), output()])
    assert got(again) == ([], [], [])
    assert got(stages.forward_output(step(), [None, output(done_first)])) == ([], ["x"], [])
    # A failure first, the other stage's success later: dropped, never reported.
    fails = KVConnectorOutput(failed_recving=[KVFailure("y", "refused")])
    assert got(stages.forward_output(step(), [fails, output()])) == ([], [], ["y"])
    late = stages.forward_output(step(), [None, output(KVConnectorOutput([], ["y"]))])
    assert got(late) == ([], [], [])


def test_a_step_s_cancels_drop_what_the_stages_reported_of_the_load() -> None:
    stages = StageReports(2, tp_size=1)
    stages.forward_output(step(), [KVConnectorOutput([], ["c"]), output()])
    # Cancelled (after a failed step), then loaded again under its id: the first
    # stage's earlier report is not counted for the new load.
    cancelled = stages.forward_output(step(["c"]), [None, output(KVConnectorOutput([], ["c"]))])
    assert got(cancelled) == ([], [], [])
    fresh = stages.forward_output(step(), [KVConnectorOutput([], ["c"]), output()])
    assert got(fresh) == ([], ["c"], [])


def test_after_a_failed_step_every_report_is_forgotten() -> None:
    """Reports of steps whose output never reached the scheduler (a step failed, and the
    ones in flight were waited out) are dropped: a load complete on every stage whose
    sample failed, parts reported by one stage. The engine's next step cancels every
    load and withdraws every save, which the stages then report anew."""
    stages = StageReports(2, tp_size=1)
    stages.forward_output(step(), [None, output(KVConnectorOutput([], ["d"]))])
    assert stages.forward_output(step(), [KVConnectorOutput(["s"], ["d", "e"]), None]) is None
    stages.reset()  # the sample of that step failed
    late = stages.forward_output(step(), [None, output(KVConnectorOutput(["s"], ["e"]))])
    assert got(late) == ([], [], [])


def test_with_sample_false_the_reports_wait_for_the_sampled_output() -> None:
    stages = StageReports(2, tp_size=4)
    assert stages.forward_output(step(), [KVConnectorOutput([], ["g"]), None]) is None
    out = stages.sample_output(output(KVConnectorOutput([], ["g"])))
    assert got(out) == ([], ["g"], [])


def test_a_reply_of_the_wrong_kind_or_count_is_an_error() -> None:
    stages = StageReports(2, tp_size=1)
    with pytest.raises(RuntimeError, match="1 stage replies to a step of 2"):
        stages.forward_output(step(), [output()])
    with pytest.raises(RuntimeError, match="stage 0 replied ModelRunnerOutput"):
        stages.forward_output(step(), [output(), output()])
    with pytest.raises(RuntimeError, match="the last stage replied KVConnectorOutput"):
        stages.forward_output(step(), [None, KVConnectorOutput()])


def test_the_combined_future_combines_once_and_passes_errors_and_waits_on() -> None:
    calls = []
    call: Future = Future()
    future = CombinedFuture(call, lambda value: calls.append(value) or value * 2)
    assert not future.done()
    with pytest.raises(FutureTimeout):  # only the wait timed out: the step goes on
        future.result(timeout=0)
    call.set_result(21)
    assert future.done()
    assert future.result() == 42 and future.result() == 42 and calls == [21]
    assert future.exception() is None
    with pytest.raises(TypeError, match="in the order of the steps"):
        future.add_done_callback(print)
    failed_call: Future = Future()
    failed = CombinedFuture(failed_call, lambda value: value)
    failed_call.set_exception(ValueError("the step failed"))
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError, match="the step failed"):
        failed.result()
