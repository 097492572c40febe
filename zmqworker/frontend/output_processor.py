"""The client's side of each step: the engine cores' outputs applied to the requests'
states (text, stop strings, logprobs), and what to tell the callers and the engines.

A step's outputs come as columns (EngineCoreOutputs). A bulk request (RequestState.bulk:
its caller wants only its end, and it has no stop strings or logprobs) that only got
tokens has them appended here, in one loop over the step; the others, and what only
some requests have (an end, a first output, logprobs), go through RequestState.apply.
Only a streamed or finished request's output is built.

Of n > 1 samples with prompt logprobs, only the first asks the engine core for them; a
sample that takes the first's (RequestState.prompt_logprobs_from) has its outputs held
until they come, with the first's first output: the engine core may send the sample's
first (the first sample preempted, or its last prompt chunk in the step the sample
starts in). A streamed one's held outputs come out as one (output() takes everything
since the last); if the first ended without them, they come out without. A prompt's
samples are aborted together (remove()), the held ones with them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from messages import EngineCoreOutputs
from zmqworker.frontend.outputs import RequestOutput
from zmqworker.frontend.request_state import RequestState

log = logging.getLogger("zmqworker.frontend")


@dataclass
class Processed:
    """What a batch of outputs gave: an output for each request that changed, the
    requests a stop string ended here and those whose outputs could not be applied here,
    with the error (both to abort in their engine core)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)


class OutputProcessor:
    """The states of the requests this client has in its engine cores, by id."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.num_late_outputs = 0  # for requests already finished or aborted here
        self._held: dict[str, RequestState] = {}  # waiting for their prompt logprobs

    def add(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request id {state.request_id!r} is already running")
        self.states[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        held = self._held.pop(request_id, None)
        return self.states.pop(request_id, held)

    def process(self, batch: EngineCoreOutputs) -> Processed:
        processed = Processed()
        now = time.monotonic()
        states = self.states
        finished = {f.index: f for f in batch.finished}
        first = {f.index: f for f in batch.first}
        logprobs = {r.index: r.rows for r in batch.logprobs}
        prompt_logprobs = {r.index: r.rows for r in batch.prompt_logprobs}  # with first
        special = finished.keys() | first.keys() | logprobs.keys()
        tokens = batch.new_token_ids.tolist()
        offsets = batch.token_offsets
        bounds = None if offsets is None else offsets.tolist()
        late = 0
        for i, request_id in enumerate(batch.request_ids):
            state = states.get(request_id)
            if state is None:  # it ended here (a stop string, an abort) while it ran on
                late += 1
                continue
            if bounds is None:
                if state.bulk and i not in special:
                    state.output_token_ids.append(tokens[i])
                    state.since_last = now - state.last_token_time  # type: ignore[operator]
                    state.last_token_time = now
                    continue
                new = tokens[i : i + 1]
            else:
                new = tokens[bounds[i] : bounds[i + 1]]
                if state.bulk and i not in special:
                    if new:
                        state.output_token_ids += new
                        state.since_last = now - state.last_token_time  # type: ignore[operator]
                        state.last_token_time = now
                    continue
            try:
                if i in prompt_logprobs:
                    state.take_prompt_logprobs(prompt_logprobs[i])
                if state.apply(new, now, finished.get(i), first.get(i), logprobs.get(i)):
                    processed.stopped.append(request_id)
                if state.finished:
                    del states[request_id]
                if state.streamed or state.finished:
                    if state.waits_for_prompt_logprobs:
                        self._held[request_id] = state
                    elif request_id not in self._held:  # else it comes out with those below
                        processed.outputs.append(state.output())
            except Exception as exc:  # its text or logprobs: it fails alone, the others go on
                log.exception("request %s: its output could not be applied", request_id)
                self.remove(request_id)
                processed.failed[request_id] = RuntimeError(
                    f"request {request_id}: its output could not be applied: "
                    f"{type(exc).__name__}: {exc}"
                )
        self.num_late_outputs += late
        if self._held:
            self._release(processed)
        return processed

    def _release(self, processed: Processed) -> None:
        """The held outputs whose prompt logprobs came (or whose first sample ended
        without them)."""
        for request_id, state in list(self._held.items()):
            if not state.waits_for_prompt_logprobs:
                del self._held[request_id]
                processed.outputs.append(state.output())
