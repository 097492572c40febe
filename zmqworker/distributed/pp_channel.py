"""The pipeline-parallel channel: stage k sends its IntermediateTensors for a step
straight to stage k+1 (same TP rank), never through the engine.

The receiving side binds a PULL socket and is driven by the worker's event loop: a
step's tensors wait in a slot keyed by the step's call id until the compute thread asks
for them, whichever comes first, so nothing is matched by arrival order. The sending side
belongs to the compute thread.

Two ways to move the tensors. Stages on one host (an ipc:// peer) share memory: the
sender copies the tensors once into a slot of its shared-memory ring (shm_ring.py), the
message says where they are, and the receiver reads them in place until the step that
used them is forgotten, which hands the slot back. Otherwise (a tcp:// peer,
ZMQWORKER_PP_SHM=0, or a host where no shared memory can be made) the tensors travel as
zero-copy frames: a tracked send, and the previous send is confirmed done before the
next one may reuse the staging buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import OrderedDict

import torch
import zmq

from messages import (
    Decoder,
    Encoder,
    IntermediateTensors,
    PipelineSharedTensors,
    PipelineTensors,
    ProtocolError,
)
from zmqworker.distributed.shm_ring import (
    ShmDescriptorError,
    ShmLease,
    ShmReceiver,
    ShmSender,
    shm_available,
)
from zmqworker.transport.async_socket import AsyncSocket

log = logging.getLogger("zmqworker.pipeline")

RECV_TIMEOUT_S = 120.0  # a step's tensors this late mean the previous stage is gone
SEND_TIMEOUT_S = 120.0
SHM_ENV = "ZMQWORKER_PP_SHM"  # "0": same-host stages send frames, not shared memory
SHM_SLOTS = 4  # more than the steps a pipeline keeps in flight
FORGOTTEN_KEPT = 256  # steps forgotten before their tensors came, remembered to drop them


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

    def __init__(self, call_id: int, src_rank: int, timeout_s: float) -> None:
        self.call_id = call_id
        self.src_rank = src_rank
        self.timeout_s = timeout_s
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
        if not self._event.wait(self.timeout_s):
            raise TimeoutError(
                f"step {self.call_id}: no intermediate tensors from rank {self.src_rank} "
                f"within {self.timeout_s:.0f} s"
            )
        if self._error is not None:
            raise self._error
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
        self._shm = ShmReceiver()
        self._slots: dict[int, PendingTensors] = {}
        self._leases: dict[int, ShmLease] = {}  # shared tensors held until forget()
        self._forgotten: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._async: AsyncSocket | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._async = AsyncSocket(self.sock, loop, self._on_message)

    def expect(
        self, call_id: int, src_rank: int, timeout_s: float = RECV_TIMEOUT_S
    ) -> PendingTensors:
        """The slot of call_id's tensors, asked for as the step starts. Tensors that came
        first for earlier calls that never asked (a call refused before it ran) go back:
        calls run in the order of their ids."""
        with self._lock:
            self._forgotten.pop(call_id, None)  # a call id used again
            stale = [
                i for i, s in self._slots.items() if i < call_id and not s.expected and s.arrived
            ]
            leases = [self._leases.pop(i) for i in stale if i in self._leases]
            for i in stale:
                del self._slots[i]
            slot = self._slots.get(call_id)
            if slot is None:
                slot = self._slots[call_id] = PendingTensors(call_id, src_rank, timeout_s)
            else:  # the tensors came first
                slot.src_rank, slot.timeout_s = src_rank, timeout_s
            slot.expected = True
        for lease in leases:
            lease.release()
        return slot

    def forget(self, call_id: int) -> None:
        """The step is over (any thread): its shared tensors go back to their sender, and
        tensors that come for it later are dropped on arrival."""
        with self._lock:
            slot = self._slots.pop(call_id, None)
            lease = self._leases.pop(call_id, None)
            if slot is None or not slot.arrived:
                self._forgotten[call_id] = None
                if len(self._forgotten) > FORGOTTEN_KEPT:
                    self._forgotten.popitem(last=False)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
        else:
            self.sock.close(linger=0)
        if self.address.startswith("ipc://"):
            # libzmq unlinks it from its I/O thread, which an exiting process may not
            # wait for; then the engine's folder (removed by the last worker out when the
            # engine was killed) would stay behind.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("ipc://") :])
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:  # a step still waiting ends now, not at its timeout
            if not slot.arrived:
                slot.fail(RuntimeError(f"rank {self.rank}: the pipeline channel is closed"))
        for lease in leases:
            lease.release()
        self._shm.close()

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self._dec.decode(frames)
        except ProtocolError as e:
            self.dropped_messages += 1
            log.warning("rank %d: dropped pipeline data that did not decode: %s", self.rank, e)
            return
        if isinstance(msg, PipelineTensors):
            self._arrived(msg.call_id, msg.src_rank, msg.tensors, None)
        elif isinstance(msg, PipelineSharedTensors):
            self._open_shared(msg)
        else:
            self.dropped_messages += 1
            log.warning(
                "rank %d: dropped a %s on the pipeline channel", self.rank, type(msg).__name__
            )

    def _open_shared(self, msg: PipelineSharedTensors) -> None:
        """Map the tensors in place; a descriptor that cannot be used fails its step."""
        shared = msg.shared
        try:
            lease = self._shm.open(shared)
        except ShmDescriptorError as e:
            self.dropped_messages += 1
            log.warning(
                "rank %d: dropped a bad shared-memory descriptor from rank %d: %s",
                self.rank, msg.src_rank, e,
            )  # fmt: skip
            error = ValueError(
                f"step {msg.call_id}: rank {msg.src_rank} sent a bad shared-memory descriptor: {e}"
            )
            self._arrived(msg.call_id, msg.src_rank, None, error)
            return
        except OSError as e:
            error = RuntimeError(
                f"step {msg.call_id}: rank {self.rank} cannot map the shared memory of rank "
                f"{msg.src_rank} (pid {shared.pid}, fd {shared.fd}): {e}. Set "
                f"{SHM_ENV}=0 to send pipeline tensors as ZMQ frames instead"
            )
            log.error("%s", error)
            self._arrived(msg.call_id, msg.src_rank, None, error)
            return
        self._arrived(msg.call_id, msg.src_rank, IntermediateTensors(lease.tensors), None, lease)

    def _arrived(
        self,
        call_id: int,
        src_rank: int,
        tensors: IntermediateTensors | None,
        error: Exception | None,
        lease: ShmLease | None = None,
    ) -> None:
        """Hand a step its tensors (or the error that replaces them); kept until forget()."""
        with self._lock:
            if call_id in self._forgotten:  # its step ended without them
                del self._forgotten[call_id]
            else:
                slot = self._slots.get(call_id)
                if slot is None:  # arrived before its step: kept for expect()
                    slot = self._slots[call_id] = PendingTensors(call_id, src_rank, 0)
                if lease is not None:
                    self._leases[call_id] = lease
                if error is not None:
                    slot.fail(error)
                else:
                    assert tensors is not None
                    slot.deliver(tensors)
                return
        if lease is not None:
            lease.release()


class PipelineSender:
    """The PUSH end, owned by the compute thread of a stage that is not the last."""

    def __init__(
        self,
        ctx: zmq.Context,
        peer_address: str,
        rank: int,
        shared_memory: bool | None = None,
        timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        """shared_memory: None decides from the address (use_shared_memory); timeout_s
        bounds every wait of a send (a free slot, a confirmed send)."""
        self.rank = rank
        self.peer_address = peer_address
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
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
                msg = PipelineSharedTensors(call_id=call_id, src_rank=self.rank, shared=shared)
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
        msg = PipelineTensors(call_id=call_id, src_rank=self.rank, tensors=host)
        self._tracker = self._send(call_id, self._enc.encode(msg), track=True)

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
        buf = self._staging.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._staging[name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return view
