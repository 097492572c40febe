"""The batch queue: up to max_concurrent_batches steps in flight, answered in order.

With pipeline parallelism, stage 0 can start step N+1 while stage 1 still computes step
N, but only if step N+1 does not need step N's tokens: the steps in flight hold disjoint
request sets (the scheduler never schedules a request whose step is still out; this queue
checks it). Outputs are consumed oldest first, the order the workers ran the steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from messages import ModelRunnerOutput, SchedulerOutput

# execute_model: the output, or a future of it.
Submit = Callable[[SchedulerOutput], "ModelRunnerOutput | Future[ModelRunnerOutput]"]


def scheduled_handles(output: SchedulerOutput) -> set[int]:
    """Handles of the requests a step computes (not those it drops)."""
    handles = {data.req_handle for data in output.scheduled_new_reqs}
    handles.update(output.scheduled_cached_reqs.req_handles.tolist())
    return handles


class BatchQueue:
    """Steps sent to the executor and not yet consumed, oldest first."""

    def __init__(self, submit: Submit, max_concurrent_batches: int) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self._submit = submit
        self.max_concurrent_batches = max_concurrent_batches
        self._steps: deque[
            tuple[SchedulerOutput, set[int], ModelRunnerOutput | Future[ModelRunnerOutput]]
        ] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.max_concurrent_batches

    def in_flight_handles(self) -> set[int]:
        return set().union(*(handles for _, handles, _ in self._steps))

    def submit(self, output: SchedulerOutput) -> None:
        """Send a step. It must not compute a request that a step in flight computes."""
        if self.full:
            raise RuntimeError(f"{len(self._steps)} steps in flight already: the queue is full")
        handles = scheduled_handles(output)
        overlap = handles & self.in_flight_handles()
        if overlap:
            raise ValueError(f"requests {sorted(overlap)} are already in a step in flight")
        self._steps.append((output, handles, self._submit(output)))

    def pop(self, timeout: float | None = None) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest step's output. On timeout the step stays in the queue; a
        step that failed leaves it, and its error is raised."""
        if not self._steps:
            raise RuntimeError("no step in flight")
        output, _, result = self._steps[0]
        if isinstance(result, Future):
            try:
                result = result.result(timeout)
            except FutureTimeout:
                if not result.done():
                    raise TimeoutError(f"oldest step not answered after {timeout} s") from None
                self._steps.popleft()  # the step itself failed with a timeout
                raise
            except BaseException:
                self._steps.popleft()
                raise
        self._steps.popleft()
        return output, result
