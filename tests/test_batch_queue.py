"""The batch queue: several steps in flight, outputs in order; the engine keeps disjoint
requests in the steps in flight of a pipeline."""

from __future__ import annotations

import random
from concurrent.futures import Future

import numpy as np
import pytest
from engine_helpers import FakeExecutor, reference_tokens, scheduled_handles

from messages import CachedRequestData, ModelRunnerOutput, SamplingParams, SchedulerOutput
from zmqworker.engine.batch_queue import BatchQueue
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import Request


def step(handles: list[int], finished: list[int] = ()) -> SchedulerOutput:
    n = len(handles)
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.build(handles, [4] * n, [1] * n),
        total_num_scheduled_tokens=n,
        finished_req_handles=list(finished),
    )


def output(handles: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(np.array(handles, np.int32), np.array(handles, np.int32) + 100)


class ManualExecutor:
    def __init__(self) -> None:
        self.futures: list[Future] = []

    def submit(self, so: SchedulerOutput) -> Future:
        self.futures.append(Future())
        return self.futures[-1]


def test_two_disjoint_steps_in_flight_and_outputs_in_order():
    executor = ManualExecutor()
    queue = BatchQueue(executor.submit, max_concurrent_batches=2)
    first, second = step([0, 1]), step([2])
    queue.submit(first)
    queue.submit(second)
    assert queue.full and len(queue) == 2
    with pytest.raises(RuntimeError, match="full"):
        queue.submit(step([4]))
    # The younger step finishes first; the older one still comes out first.
    executor.futures[1].set_result(output([2]))
    with pytest.raises(TimeoutError, match="not answered"):
        queue.pop(timeout=0.01)
    assert len(queue) == 2
    executor.futures[0].set_result(output([0, 1]))
    so, out = queue.pop()
    assert so is first and out.req_handles.tolist() == [0, 1]
    # A step may drop a request that an older step in flight computes (an abort).
    queue.submit(step([0], finished=[2]))
    so, out = queue.pop()
    assert so is second and out.sampled_token_ids.tolist() == [102]


def test_failed_step_leaves_the_queue_with_its_error():
    executor = ManualExecutor()
    queue = BatchQueue(executor.submit, max_concurrent_batches=2)
    queue.submit(step([0]))
    executor.futures[0].set_exception(RuntimeError("rank 1 died"))
    with pytest.raises(RuntimeError, match="rank 1 died"):
        queue.pop()
    assert len(queue) == 0
    with pytest.raises(RuntimeError, match="no step in flight"):
        queue.pop()


def test_depth_one_takes_plain_outputs():
    queue = BatchQueue(lambda so: output(sorted(scheduled_handles(so))), 1)
    queue.submit(step([5, 6]))
    assert queue.full
    assert queue.pop()[1].req_handles.tolist() == [5, 6]
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        BatchQueue(lambda so: output([]), 0)


def test_engine_keeps_two_disjoint_steps_in_flight_at_depth_two():
    executor = FakeExecutor(num_blocks=64, pipeline_parallel_size=2, defer=True)
    core = EngineCore(executor, max_model_len=40)
    rng = random.Random(1)
    requests = [
        Request(f"r{i}", [rng.randrange(50) for _ in range(5 + i)], SamplingParams(max_tokens=8))
        for i in range(6)
    ]
    for request in requests:
        core.add_request(request)
    for _ in range(500):
        if not core.has_work():
            break
        core.step()
    assert not core.has_work()
    # Most steps went out while another was in flight, and never shared a request.
    sent = executor.workers[-1].steps
    overlapped = 0
    for so, in_flight in zip(sent, executor.in_flight_at_submit, strict=True):
        assert len(in_flight) <= 1
        if in_flight:
            overlapped += 1
            assert in_flight[0] and not in_flight[0] & scheduled_handles(so)
    assert overlapped >= len(sent) // 2
    for request in requests:
        assert request.output_token_ids == reference_tokens(
            request.prompt_token_ids, 8, executor.token_fn
        )


def test_a_collective_rpc_without_a_timeout_has_the_executor_s_call_bound():
    """WorkerCall's timeout nil means the executor's bound (protocol.md); it reached the
    executor as None, no bound at all."""

    class Recording(FakeExecutor):
        call_timeout_s = 12.5

        def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
            self.timeouts.append(timeout)
            return [None]

    executor = Recording(num_blocks=16)
    executor.timeouts = []
    core = EngineCore(executor, max_model_len=40)
    core.collective_rpc("echo")
    core.collective_rpc("echo", timeout=3.0)
    assert executor.timeouts == [12.5, 3.0]
