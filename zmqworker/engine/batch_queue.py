"""The batch queue: the executor's answers to the steps in flight, oldest first.

The scheduler keeps the record of the steps in flight (in_flight.py: what each computes
and samples) and builds every step from it: with pipeline stages the steps in flight
hold disjoint requests, with async scheduling a step goes on from the one before. This
queue holds only what the executor gave back for each step sent (its output, or a future
of it), up to max_concurrent_batches, and hands them out in the order the workers ran
the steps.

A step whose sampling needs a grammar bitmask is sent in two calls (the forward with
sample=False, then sample_tokens with the bitmask): the engine submits it with the
forward's future as a DeferredSample, which takes the sample's future once the bitmask
is sent (it must be before the step is popped).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from messages import ModelRunnerOutput, SchedulerOutput


@dataclass
class DeferredSample:
    """A step sent as execute_model(sample=False) (forward: its future, of None) then
    sample_tokens (sample: the future of the step's output; None until it is sent)."""

    forward: Future[None]
    sample: Future[ModelRunnerOutput] | None = None


Sent = ModelRunnerOutput | Future[ModelRunnerOutput] | DeferredSample
# execute_model: the output, or a future of it.
Submit = Callable[[SchedulerOutput], Sent]


class BatchQueue:
    """Steps sent to the executor and not yet consumed, oldest first."""

    def __init__(self, submit: Submit, max_concurrent_batches: int) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        self._submit = submit
        self.max_concurrent_batches = max_concurrent_batches
        self._steps: deque[tuple[SchedulerOutput, Sent]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.max_concurrent_batches

    def submit(self, output: SchedulerOutput, send: Submit | None = None) -> None:
        """Send a step (through send instead of the queue's submit when given)."""
        if self.full:
            raise RuntimeError(f"{len(self._steps)} steps in flight already: the queue is full")
        self._steps.append((output, (send or self._submit)(output)))

    def unsent_samples(self) -> list[DeferredSample]:
        """The steps in flight whose sample_tokens has not gone out."""
        return [s for _, s in self._steps if isinstance(s, DeferredSample) and s.sample is None]

    def pop(self, timeout: float | None = None) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest step's output. On timeout the step stays in the queue; a
        step that failed leaves it, and its error is raised."""
        if not self._steps:
            raise RuntimeError("no step in flight")
        output, sent = self._steps[0]
        if isinstance(sent, DeferredSample):
            if sent.sample is None:  # a caller's error: the step leaves, as a failed one
                self._steps.popleft()
                raise RuntimeError("the oldest step's sample_tokens was never sent")
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
