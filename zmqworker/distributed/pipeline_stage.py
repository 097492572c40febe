"""A rank's place in the pipeline, as its Worker uses it in a step: where the step's
input tensors come from and where its output tensors go (pp_channel.py carries them).

A step is named by the id of the execute_model call the engine sent to every rank, so
stages match their tensors by id, never by arrival order. The receive is posted as the
step starts and waited for only once the step's inputs are ready (the transfer overlaps
the preparation); the send does not wait for the next stage. A rank that refuses a step
tells the next stage so (refuse), which then fails it at once instead of waiting for its
tensors.
"""

from __future__ import annotations

import time

from messages import IntermediateTensors
from zmqworker.distributed.pp_channel import PendingTensors
from zmqworker.distributed.pp_receiver import PipelineReceiver
from zmqworker.distributed.pp_sender import PipelineSender

DEADLINE_MARGIN_S = 2.0  # a stage's wait ends this much before the step's deadline, at most


class PipelineStage:
    """receiver: this rank's PULL end (every rank binds one before its Hello); sender:
    the PUSH end to the next stage's rank (None on the last stage); previous_rank: the
    rank that sends this one its inputs (None on the first stage)."""

    def __init__(
        self,
        receiver: PipelineReceiver,
        sender: PipelineSender | None,
        previous_rank: int | None,
    ) -> None:
        self.receiver = receiver
        self.sender = sender
        self.previous_rank = previous_rank

    @property
    def is_first(self) -> bool:
        return self.previous_rank is None

    @property
    def is_last(self) -> bool:
        return self.sender is None

    def receive(self, step_id: int, deadline: float = 0.0) -> PendingTensors | None:
        """The previous stage's tensors of this step, once they arrive (None on the first
        stage), waited for until just before deadline (a time.time() instant, the step
        call's: about as long as the engine waits for the step, whose refusal by this
        stage then reaches it first; 0: no bound, the previous stage's refusal or the
        pipeline's end ends the wait). Call done(step_id) when the step is over."""
        if self.previous_rank is None:
            return None
        left = deadline - time.time()
        timeout_s = max(0.0, left - min(DEADLINE_MARGIN_S, left / 10)) if deadline else None
        return self.receiver.expect(step_id, self.previous_rank, timeout_s)

    def done(self, step_id: int) -> None:
        """The step is over: its input tensors (and their shared memory) go back."""
        if self.previous_rank is not None:
            self.receiver.forget(step_id)

    def refuse(self, step_id: int, error: BaseException) -> None:
        """This rank refused the step (error): the next stage, if any, fails it too."""
        if self.sender is not None:
            self.sender.refuse(step_id, error)

    def send(self, step_id: int, tensors: IntermediateTensors) -> None:
        if self.sender is None:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        self.sender.send(step_id, tensors)

    def close(self) -> None:
        """Close the sender (the receiver belongs to the event loop that drives it)."""
        if self.sender is not None:
            self.sender.close()
