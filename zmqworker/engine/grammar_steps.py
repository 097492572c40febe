"""How the engine core sends a step that samples for requests with a grammar: as its
forward (execute_model, sample=False) first; while the workers run it, the engine takes
back the steps in flight that sample for those requests (their matchers must hold those
tokens), fills the step's bitmask (structured_outputs.py: xgrammar's work in threads of
its own while this thread waits, so that none of them waits for the GIL) and sends it
with sample_tokens at once: the workers get it as early as the engine can make it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from messages import GrammarOutput, SchedulerOutput
from zmqworker.engine.batch_queue import BatchQueue, DeferredSample
from zmqworker.engine.request import Request
from zmqworker.engine.scheduler import Scheduler
from zmqworker.engine.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from zmqworker.executor.abstract import Executor


class GrammarSteps:
    """The engine core's steps with a grammar."""

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        batch_queue: BatchQueue,
        structured: StructuredOutputs | None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.batch_queue = batch_queue
        self.structured = structured
        # Bitmask arrays, taken in turn: one for each step that can be in flight and one
        # filling, so that an array is filled again only once its step is back (the
        # workers' frames may still be read from it until then).
        self._num_slots = batch_queue.max_concurrent_batches + 1
        self._slot = 0

    def submit(self, output: SchedulerOutput, requests: list[Request]) -> list[Request]:
        """Send output's forward (the step just made, which samples for requests, those
        with a grammar), take back the steps in flight that sample for them, fill the
        step's bitmask and send it with sample_tokens; the requests those steps changed.
        If anything fails on the way (a step in flight, or a token that a grammar does not
        allow), the workers get sample_tokens without a bitmask, so that they end the
        step, and the error is raised."""
        if self.structured is None:
            raise RuntimeError("a step with grammars on an engine core without them")
        forward = self.executor.execute_model(output, sample=False, non_block=True)
        deferred = DeferredSample(forward)
        self.batch_queue.submit(output, lambda _: deferred)
        bitmask: GrammarOutput | None = None
        try:
            changed: list[Request] = []
            in_flight = self.scheduler.in_flight
            while len(self.batch_queue) > 1 and in_flight.structured_waits(output):
                earlier, runner_output = self.batch_queue.pop()
                changed += self.scheduler.update_from_output(earlier, runner_output)
            bitmask = self.structured.fill(requests, self._slot)
            self._slot = (self._slot + 1) % self._num_slots
        finally:
            deferred.sample = self.executor.sample_tokens(bitmask, non_block=True)
        return changed
