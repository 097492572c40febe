"""The pipeline-parallel channel: stage k sends its IntermediateTensors for a step
straight to stage k+1 (same TP rank), never through the engine.

The receiving side (pp_receiver.py) binds a PULL socket and is driven by the worker's
event loop: a step's tensors wait in a slot keyed by the step's call id until the compute
thread asks for them, whichever comes first, so nothing is matched by arrival order; it
takes only what the previous stage of this run sends for a step in flight. The sending
side (pp_sender.py) belongs to the compute thread.

Two ways to move the tensors. Stages on one host (an ipc:// peer) share memory: the
sender copies the tensors once into a slot of its shared-memory ring (shm_ring.py), the
message says where they are, and the receiver reads them in place until the step that
used them is forgotten, which hands the slot back. Otherwise (a tcp:// peer,
ZMQWORKER_PP_SHM=0, or a host where no shared memory can be made) the tensors travel as
zero-copy frames: a tracked send, and the previous send is confirmed done before the
next one may reuse the staging buffers.
"""

from __future__ import annotations

import os
import threading
import time

from messages import IntermediateTensors
from zmqworker.distributed.shm_ring import shm_available

SEND_TIMEOUT_S = 120.0
SHM_ENV = "ZMQWORKER_PP_SHM"  # "0": same-host stages send frames, not shared memory
SHM_SLOTS = 4  # more than the steps a pipeline keeps in flight


def use_shared_memory(peer_address: str) -> bool:
    """Whether a sender to peer_address moves tensors through shared memory: the peer is
    on this host (ipc://), the platform has memfd, and ZMQWORKER_PP_SHM is not "0"."""
    return (
        peer_address.startswith("ipc://")
        and shm_available()
        and os.environ.get(SHM_ENV, "1") != "0"
    )


class PendingTensors:
    """The tensors of one step, once they arrive. wait() is what the runner calls when it
    needs them, on the compute thread; the loop thread delivers them."""

    def __init__(self, call_id: int, src_rank: int, until: float | None) -> None:
        self.call_id = call_id
        self.src_rank = src_rank
        self.until = until  # a time.monotonic() instant; None: no bound
        self.expected = False  # a step asked for these (else they came first)
        self._event = threading.Event()
        self._tensors: IntermediateTensors | None = None
        self._error: Exception | None = None

    @property
    def arrived(self) -> bool:
        return self._event.is_set()

    def deliver(self, tensors: IntermediateTensors) -> None:
        self._tensors = tensors
        self._event.set()

    def fail(self, error: Exception) -> None:
        """The tensors came but cannot be used: wait() raises error."""
        self._error = error
        self._event.set()

    def wait(self) -> IntermediateTensors:
        timeout_s = None if self.until is None else max(0.0, self.until - time.monotonic())
        if not self._event.wait(timeout_s):
            raise TimeoutError(
                f"step {self.call_id}: no intermediate tensors from rank {self.src_rank} "
                "by the step's deadline"
            )
        if self._error is not None:
            raise self._error
        assert self._tensors is not None
        return self._tensors
