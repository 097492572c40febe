"""The batch queue: up to max_concurrent_batches steps in flight, answered in order.

With pipeline parallelism, stage 0 can start step N+1 while stage 1 still computes step
N, but only if step N+1 does not need step N's tokens: the steps in flight hold disjoint
request sets (the scheduler never schedules a request whose step is still out; this queue
checks it). With async scheduling (one stage), step N+1 may go on from step N instead: a
request in both is a cached request of step N+1 whose computed tokens start exactly where
step N's end, never a new one. Outputs are consumed oldest first, the order the workers
ran the steps.

A step whose sampling needs a grammar bitmask is sent in two calls (the forward with
sample=False, then sample_tokens with the bitmask): the engine submits it with the
forward's future and the sample's as a DeferredSample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from messages import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class DeferredSample:
    """A step sent as execute_model(sample=False) (forward: its future, of None) then
    sample_tokens (sample: the future of the step's output)."""

    forward: Future[None]
    sample: Future[ModelRunnerOutput]


Sent = ModelRunnerOutput | Future[ModelRunnerOutput] | DeferredSample
# execute_model: the output, or a future of it.
Submit = Callable[[SchedulerOutput], Sent]


def scheduled_ends(output: SchedulerOutput) -> dict[int, int]:
    """Handle -> tokens computed once the step has run, for the requests it computes."""
    ends = {
        r.req_handle: r.num_computed_tokens + r.num_scheduled_tokens
        for r in output.scheduled_new_reqs
    }
    cached = output.scheduled_cached_reqs
    computed = cached.num_computed_tokens + cached.num_scheduled_tokens
    ends.update(zip(cached.req_handles.tolist(), computed.tolist(), strict=True))
    return ends


class BatchQueue:
    """Steps sent to the executor and not yet consumed, oldest first."""

    def __init__(
        self, submit: Submit, max_concurrent_batches: int, continue_in_flight: bool = False
    ) -> None:
        """continue_in_flight: async scheduling; a step may go on from the steps in
        flight instead of holding other requests."""
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self._submit = submit
        self.max_concurrent_batches = max_concurrent_batches
        self.continue_in_flight = continue_in_flight
        self._steps: deque[tuple[SchedulerOutput, dict[int, int], Sent]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.max_concurrent_batches

    def in_flight_ends(self) -> dict[int, int]:
        """Handle -> tokens computed once the steps in flight have run."""
        ends: dict[int, int] = {}
        for _, step_ends, _ in self._steps:
            ends.update(step_ends)
        return ends

    def submit(self, output: SchedulerOutput, send: Submit | None = None) -> None:
        """Send a step (through send instead of the queue's submit when given). A request
        that a step in flight computes may be in it only as the continuation of that step
        (continue_in_flight)."""
        if self.full:
            raise RuntimeError(f"{len(self._steps)} steps in flight already: the queue is full")
        ends = scheduled_ends(output)
        in_flight = self.in_flight_ends()
        overlap = sorted(ends.keys() & in_flight.keys())
        if overlap and not self.continue_in_flight:
            raise ValueError(f"requests {overlap} are already in a step in flight")
        if overlap:
            cached = output.scheduled_cached_reqs
            starts = dict(
                zip(cached.req_handles.tolist(), cached.num_computed_tokens.tolist(), strict=True)
            )
            broken = [h for h in overlap if starts.get(h) != in_flight[h]]
            if broken:
                raise ValueError(
                    f"requests {broken} are in a step in flight, and this step does not start "
                    "where that one ends"
                )
        self._steps.append((output, ends, (send or self._submit)(output)))

    def pop(self, timeout: float | None = None) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest step's output. On timeout the step stays in the queue; a
        step that failed leaves it, and its error is raised."""
        if not self._steps:
            raise RuntimeError("no step in flight")
        output, _, sent = self._steps[0]
        if isinstance(sent, DeferredSample):
            futures: list[Future] = [sent.forward, sent.sample]
        elif isinstance(sent, Future):
            futures = [sent]
        else:
            self._steps.popleft()
            return output, sent
        for future in futures:  # the forward's errors first: the sample's follow from them
            try:
                result = future.result(timeout)
            except FutureTimeout:
                if not future.done():
                    raise TimeoutError(f"oldest step not answered after {timeout} s") from None
                self._steps.popleft()  # the step itself failed with a timeout
                raise
            except BaseException:
                self._steps.popleft()
                raise
        self._steps.popleft()
        return output, result
