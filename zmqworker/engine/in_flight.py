"""The steps in flight: scheduled and sent, their outputs not applied yet. One record, the
scheduler's; the batch queue holds only the executor's futures of the same steps.

Per request handle it counts the steps in flight that compute the request, and the tokens
they will sample for it (placeholders, with async scheduling): the scheduler reads both
for every running request each step, so they are columns indexed by handle. A handle is
never reused while a step in flight names it (handles.py), so the counts of a request
that finished or was aborted meanwhile stay right until its steps are back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from messages import SchedulerOutput


@dataclass
class SentStep:
    """A step sent to the workers and not yet answered."""

    output: SchedulerOutput
    handles: np.ndarray  # every request it computes
    sampling: np.ndarray  # those whose next token it samples (handles itself when all do)
    finished_handles: list[int]  # the finishes it reports to the workers
    structured: np.ndarray  # the handles it samples for that have a grammar

    @property
    def all_sample(self) -> bool:
        return self.sampling is self.handles


class StepsInFlight:
    """Oldest first; outputs are applied in the order the steps were sent."""

    def __init__(self, capacity: int = 16) -> None:
        self._steps: deque[SentStep] = deque()
        self._mark = np.zeros(capacity, bool)  # scratch: a step's sampling handles
        self._counts = np.zeros((2, capacity), np.int64)
        self._bind()

    def _bind(self) -> None:
        self.num_steps, self.num_samples = self._counts  # by handle

    def __len__(self) -> int:
        return len(self._steps)

    def newest(self, output: SchedulerOutput) -> SentStep:
        """output's step, which must be the newest (the step just made)."""
        if not self._steps or self._steps[-1].output is not output:
            raise RuntimeError("the step asked of is not the one just made")
        return self._steps[-1]

    def structured_waits(self, output: SchedulerOutput) -> bool:
        """Whether an older step in flight samples for one of the requests with a grammar
        that output (the newest) samples for: their matchers must take its token first."""
        handles = self.newest(output).structured
        return bool((self.num_samples[handles] > 1).any())

    def steps_of(self, handle: int) -> int:
        """The steps in flight that compute handle's request."""
        return int(self.num_steps[handle]) if handle < len(self.num_steps) else 0

    def reserve(self, handle: int) -> None:
        """Make room for handle (a new request's, before its first step)."""
        if handle >= len(self.num_steps):
            self._grow(2 * handle + 2)

    def add(self, step: SentStep) -> None:
        self._count(step, 1)
        self._steps.append(step)

    def pop(self, output: SchedulerOutput) -> SentStep:
        """The oldest step, which must be output's, no longer in flight."""
        if not self._steps or self._steps[0].output is not output:
            raise RuntimeError("step outputs must come back in the order the steps were made")
        step = self._steps.popleft()
        self._count(step, -1)
        return step

    def _count(self, step: SentStep, delta: int) -> None:
        self.num_steps[step.handles] += delta
        self.num_samples[step.sampling] += delta

    def samples(self, step: SentStep, handles: np.ndarray) -> np.ndarray | None:
        """Which of handles (all of step's) the step samples a token for: a mask, or None
        when it samples for all."""
        if step.all_sample:
            return None
        mark = self._mark
        mark[step.sampling] = True
        sampled = mark[handles]
        mark[step.sampling] = False
        return sampled

    def clear(self) -> None:
        self._steps.clear()
        self._counts[:] = 0

    def _grow(self, capacity: int) -> None:
        counts = np.zeros((2, capacity), np.int64)
        counts[:, : self._counts.shape[1]] = self._counts
        self._counts, self._mark = counts, np.zeros(capacity, bool)
        self._bind()
