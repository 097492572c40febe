"""The sending end of the pipeline channel: the PUSH socket of a stage that is not the
last, owned by its compute thread (pp_channel.py says how the tensors travel)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from messages import (
    Encoder,
    IntermediateTensors,
    PipelineSharedTensors,
    PipelineStepRefused,
    PipelineTensors,
)
from zmqworker.distributed.pp_channel import SEND_TIMEOUT_S, SHM_SLOTS, use_shared_memory
from zmqworker.distributed.shm_ring import ShmSender
from zmqworker.transport.curve import WorkerKeys, make_client

if TYPE_CHECKING:
    import torch

log = logging.getLogger("zmqworker.pipeline")


class PipelineSender:
    """The PUSH end, owned by the compute thread of a stage that is not the last."""

    def __init__(
        self,
        ctx: zmq.Context,
        peer_address: str,
        rank: int,
        run_id: str,
        shared_memory: bool | None = None,
        timeout_s: float = SEND_TIMEOUT_S,
        keys: WorkerKeys | None = None,
    ) -> None:
        """run_id: the run's secret id, which every message carries. shared_memory: None
        decides from the address (use_shared_memory); timeout_s bounds every wait of a
        send (a free slot, a confirmed send); keys: the socket is a CURVE client of the
        next stage's receiver (tcp)."""
        self.rank = rank
        self.peer_address = peer_address
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        if keys is not None:
            make_client(self.sock, keys, keys.public)  # every receiver has the workers' pair
        self.sock.connect(peer_address)
        if shared_memory is None:
            shared_memory = use_shared_memory(peer_address)
        self._ring = (
            ShmSender(f"the receiver at {peer_address}", SHM_SLOTS, timeout_s)
            if shared_memory
            else None
        )
        self._enc = Encoder()
        self._tracker: zmq.MessageTracker | None = None
        self._staging: dict[str, torch.Tensor] = {}

    @property
    def shared_memory(self) -> bool:
        """Whether the tensors go through shared memory rather than frames."""
        return self._ring is not None

    def send(self, call_id: int, tensors: IntermediateTensors) -> None:
        if self._ring is not None:
            try:
                shared = self._ring.put(tensors.tensors)
            except TimeoutError as e:
                raise TimeoutError(f"rank {self.rank}: step {call_id}: {e}") from None
            except OSError as e:  # no segment could be made here (a sandboxed kernel)
                log.warning(
                    "rank %d: no shared memory for %s (%s): sending frames from now on",
                    self.rank, self.peer_address, e,
                )  # fmt: skip
                self._ring.close()
                self._ring = None
            else:
                msg = PipelineSharedTensors(
                    call_id=call_id, src_rank=self.rank, shared=shared, run_id=self.run_id
                )
                self._send(call_id, self._enc.encode(msg), track=False)
                return
        if self._tracker is not None and not self._tracker.done:
            try:
                self._tracker.wait(self.timeout_s)
            except zmq.NotDone:
                raise TimeoutError(
                    f"rank {self.rank}: the previous send to {self.peer_address} was not "
                    f"taken within {self.timeout_s:g} s"
                ) from None
        host = IntermediateTensors({k: self._to_host(k, v) for k, v in tensors.tensors.items()})
        msg = PipelineTensors(call_id=call_id, src_rank=self.rank, tensors=host, run_id=self.run_id)
        self._tracker = self._send(call_id, self._enc.encode(msg), track=True)

    def refuse(self, call_id: int, error: BaseException) -> None:
        """Tell the next stage this step was refused here, so that it fails the step at
        once rather than when its wait for the tensors ends. Best effort: a refusal that
        cannot go out leaves that wait."""
        reason = f"{type(error).__name__}: {error}"[:4096]
        msg = PipelineStepRefused(call_id, self.rank, reason, self.run_id)
        try:
            self.sock.send_multipart(self._enc.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("rank %d: step %d's refusal was not sent: %s", self.rank, call_id, e)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._ring is not None:
            self._ring.close()

    def _send(self, call_id: int, frames: list, track: bool) -> zmq.MessageTracker | None:
        try:
            return self.sock.send_multipart(frames, copy=not track, track=track)
        except zmq.Again:
            raise TimeoutError(
                f"rank {self.rank}: step {call_id} could not be sent to {self.peer_address} "
                f"within {self.timeout_s:g} s"
            ) from None

    def _to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """CPU tensors go into the frames as they are; device tensors through a pinned
        staging buffer, reused from step to step (hence the tracker above)."""
        if t.device.type == "cpu":
            return t
        import torch

        buf = self._staging.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._staging[name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return view
