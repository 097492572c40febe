"""The client's side of each step: the engine cores' outputs applied to the requests'
states (text, stop strings, logprobs), and what to tell the callers and the engines."""

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
    """What a batch of outputs gave: an output for each request that changed, and the
    requests a stop string ended here (to abort in their engine core)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)


class OutputProcessor:
    """The states of the requests this client has in its engine cores, by id."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.num_late_outputs = 0  # for requests already finished or aborted here

    def add(self, state: RequestState) -> None:
        if state.request_id in self.states:
            raise ValueError(f"request id {state.request_id!r} is already running")
        self.states[state.request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(self, batch: EngineCoreOutputs) -> Processed:
        processed = Processed()
        now = time.monotonic()
        states = self.states
        for out in batch.outputs:
            state = states.get(out.request_id)
            if state is None:  # it ended here (a stop string, an abort) while it ran on
                self.num_late_outputs += 1
                continue
            if state.apply(out, now):
                processed.stopped.append(out.request_id)
            if state.finished:
                del states[out.request_id]
            processed.outputs.append(state.output())
        return processed
