"""How the engine core sends a step that samples for requests with a grammar: as its
forward (execute_model, sample=False) first; while the workers run it, the engine takes
back the steps in flight that sample for those requests (their matchers must hold those
tokens) and starts filling the step's bitmask in another thread (structured_outputs.py);
the engine goes on with the outputs of the steps it took back meanwhile, and send()
gives the workers the bitmask with sample_tokens before anything else reaches them."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from messages import SchedulerOutput
from zmqworker.engine.batch_queue import BatchQueue, DeferredSample
from zmqworker.engine.request import Request
from zmqworker.engine.scheduler import Scheduler
from zmqworker.engine.structured_outputs import Filled, StructuredOutputs

if TYPE_CHECKING:
    from zmqworker.executor.abstract import Executor


class GrammarSteps:
    """The engine core's steps with a grammar; at most one waits for its bitmask."""

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
        # The newest step's slot in the batch queue and its bitmask's future, until sent.
        self._unsent: tuple[DeferredSample, Future[Filled]] | None = None
        # Bitmask arrays, taken in turn: one for each step that can be in flight and one
        # filling, so that an array is filled again only once its step is back.
        self._num_slots = batch_queue.max_concurrent_batches + 1
        self._slot = 0

    def submit(self, output: SchedulerOutput, requests: list[Request]) -> list[Request]:
        """Send output's forward (the step just made, which samples for requests, those
        with a grammar) and start its bitmask once the steps in flight that sample for
        them are back; the requests those steps changed. send() must follow before
        anything else is sent or popped."""
        if self.structured is None:
            raise RuntimeError("a step with grammars on an engine core without them")
        if self._unsent is not None:
            raise RuntimeError("the step before still waits for its sample_tokens")
        forward = self.executor.execute_model(output, sample=False, non_block=True)
        deferred = DeferredSample(forward)
        self.batch_queue.submit(output, lambda _: deferred)
        changed: list[Request] = []
        in_flight = self.scheduler.in_flight
        while len(self.batch_queue) > 1 and in_flight.structured_waits(output):
            earlier, runner_output = self.batch_queue.pop()
            changed += self.scheduler.update_from_output(earlier, runner_output)
        self._unsent = (deferred, self.structured.fill(requests, self._slot))
        self._slot = (self._slot + 1) % self._num_slots
        return changed

    def send(self) -> list[Request]:
        """Send the newest step's sample_tokens, once its bitmask is filled, if it waits
        for that; the requests aborted because their grammar refused a token they
        sampled (each with its error). If the fill failed, the workers get no bitmask,
        so that they end the step, and the fill's error is raised."""
        if self._unsent is None:
            return []
        deferred, grammar = self._unsent
        self._unsent = None
        error = grammar.exception()
        filled = grammar.result() if error is None else Filled(None, {})
        deferred.sample = self.executor.sample_tokens(filled.output, non_block=True)
        if error is not None:
            raise error
        aborted = []
        for req_id, why in filled.refused.items():
            request = self.scheduler.abort_request(req_id)  # its token in flight is dropped
            if request is not None:
                request.error = why
                aborted.append(request)
        return aborted

    def end_unsent(self) -> None:
        """After a failed step: every step in flight whose sample_tokens never went out
        (a failure came between its forward and its bitmask) gets one without a bitmask,
        so that the workers end it and take steps again; where even that cannot be sent,
        a failed future stands for it."""
        self._unsent = None
        for deferred in self.batch_queue.unsent_samples():
            try:
                deferred.sample = self.executor.sample_tokens(None, non_block=True)
            except Exception as exc:
                failed: Future = Future()
                failed.set_exception(exc)
                deferred.sample = failed
