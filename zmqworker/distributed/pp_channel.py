"""The pipeline-parallel channel: stage k sends its IntermediateTensors for a step
straight to stage k+1 (same TP rank), never through the engine.

The receiving side binds a PULL socket and is driven by the worker's event loop: a
step's tensors wait in a slot keyed by the step's call id until the compute thread asks
for them, whichever comes first, so nothing is matched by arrival order. The sending side
belongs to the compute thread: a zero-copy, tracked send, and the previous send is
confirmed done before the next one may reuse the staging buffers.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import torch
import zmq

from messages import Decoder, Encoder, IntermediateTensors, PipelineTensors, ProtocolError
from zmqworker.runtime.async_socket import AsyncSocket

log = logging.getLogger("zmqworker.pipeline")

RECV_TIMEOUT_S = 120.0  # a step's tensors this late mean the previous stage is gone
SEND_TIMEOUT_S = 120.0


class PendingTensors:
    """The tensors of one step, once they arrive. wait() is what the runner calls when it
    needs them, on the compute thread; the loop thread delivers them."""

    def __init__(self, call_id: int, src_rank: int, timeout_s: float) -> None:
        self.call_id = call_id
        self.src_rank = src_rank
        self.timeout_s = timeout_s
        self._event = threading.Event()
        self._tensors: IntermediateTensors | None = None

    def deliver(self, tensors: IntermediateTensors) -> None:
        self._tensors = tensors
        self._event.set()

    def wait(self) -> IntermediateTensors:
        if not self._event.wait(self.timeout_s):
            raise TimeoutError(
                f"step {self.call_id}: no intermediate tensors from rank {self.src_rank} "
                f"within {self.timeout_s:.0f} s"
            )
        assert self._tensors is not None
        return self._tensors


class PipelineReceiver:
    """The PULL end, bound by every worker at start (its address goes in the Hello)."""

    def __init__(self, ctx: zmq.Context, bind_address: str, rank: int) -> None:
        self.rank = rank
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind_address.startswith("tcp://") and bind_address.endswith(":*"):
            port = self.sock.bind_to_random_port(bind_address[: -len(":*")])
            self.address = f"{bind_address[: -len(':*')]}:{port}"
        else:
            self.sock.bind(bind_address)
            self.address = bind_address
        self.dropped_messages = 0
        self._dec = Decoder()
        self._slots: dict[int, PendingTensors] = {}
        self._lock = threading.Lock()
        self._async: AsyncSocket | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._async = AsyncSocket(self.sock, loop, self._on_message)

    def expect(
        self, call_id: int, src_rank: int, timeout_s: float = RECV_TIMEOUT_S
    ) -> PendingTensors:
        """The slot of call_id's tensors (posted before the step starts, on the loop)."""
        with self._lock:
            slot = self._slots.pop(call_id, None)
            if slot is None:
                slot = self._slots[call_id] = PendingTensors(call_id, src_rank, timeout_s)
            else:  # the tensors came first
                slot.src_rank, slot.timeout_s = src_rank, timeout_s
            return slot

    def forget(self, call_id: int) -> None:
        with self._lock:
            self._slots.pop(call_id, None)

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
        else:
            self.sock.close(linger=0)

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self._dec.decode(frames)
        except ProtocolError as e:
            self.dropped_messages += 1
            log.warning("rank %d: dropped pipeline data that did not decode: %s", self.rank, e)
            return
        if not isinstance(msg, PipelineTensors):
            self.dropped_messages += 1
            log.warning(
                "rank %d: dropped a %s on the pipeline channel", self.rank, type(msg).__name__
            )
            return
        with self._lock:
            slot = self._slots.pop(msg.call_id, None)
            if slot is None:  # arrived before its step: keep it for expect()
                slot = self._slots[msg.call_id] = PendingTensors(msg.call_id, msg.src_rank, 0)
        slot.deliver(msg.tensors)


class PipelineSender:
    """The PUSH end, owned by the compute thread of a stage that is not the last."""

    def __init__(self, ctx: zmq.Context, peer_address: str, rank: int) -> None:
        self.rank = rank
        self.peer_address = peer_address
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self.sock.connect(peer_address)
        self._enc = Encoder()
        self._tracker: zmq.MessageTracker | None = None
        self._staging: dict[str, torch.Tensor] = {}

    def send(self, call_id: int, tensors: IntermediateTensors) -> None:
        if self._tracker is not None and not self._tracker.done:
            try:
                self._tracker.wait(SEND_TIMEOUT_S)
            except zmq.NotDone:
                raise TimeoutError(
                    f"rank {self.rank}: the previous send to {self.peer_address} was not "
                    f"taken within {SEND_TIMEOUT_S:.0f} s"
                ) from None
        host = IntermediateTensors({k: self._to_host(k, v) for k, v in tensors.tensors.items()})
        frames = self._enc.encode(
            PipelineTensors(call_id=call_id, src_rank=self.rank, tensors=host)
        )
        try:
            self._tracker = self.sock.send_multipart(frames, copy=False, track=True)
        except zmq.Again:
            raise TimeoutError(
                f"rank {self.rank}: step {call_id} could not be sent to {self.peer_address} "
                f"within {SEND_TIMEOUT_S:.0f} s"
            ) from None

    def close(self) -> None:
        self.sock.close(linger=0)

    def _to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """CPU tensors go into the frames as they are; device tensors through a pinned
        staging buffer, reused from step to step (hence the tracker above)."""
        if t.device.type == "cpu":
            return t
        buf = self._staging.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._staging[name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return view
