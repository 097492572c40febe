"""The receiving end of the pipeline channel: the PULL socket every worker binds before
its Hello (the Hello carries its address), driven by the worker's event loop.

It takes a message only from the previous stage of this run, for a step in flight:
- after the Welcome (admit), the message must carry the run's secret id and come from
  the rank before this one; on tcp the socket is a CURVE server too, so a peer without
  the run's key cannot even connect;
- its call id must lie in the window of steps in flight: above every step already over
  (those run in the order of their ids), and at most MAX_AHEAD above the newest call this
  worker has been sent (note_call);
- at most MAX_EARLY messages wait for steps that have not asked for them yet.
Anything else is dropped and counted, never stored; a shared-memory slot named by a
message of the run that is turned away goes back to its sender at once, so that no
message can wedge the ring or grow memory. Frames are bounded by ZMQ_MAXMSGSIZE.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time

import zmq

from messages import (
    Decoder,
    IntermediateTensors,
    PipelineMessage,
    PipelineSharedTensors,
    PipelineStepRefused,
    PipelineTensors,
    ProtocolError,
)
from zmqworker.distributed.pp_channel import SHM_ENV, PendingTensors
from zmqworker.distributed.shm_ring import ShmDescriptorError, ShmLease, ShmReceiver
from zmqworker.transport.async_socket import AsyncSocket
from zmqworker.transport.curve import WorkerKeys, make_server
from zmqworker.transport.drops import DropCounter

log = logging.getLogger("zmqworker.pipeline")

MAX_AHEAD = 64  # call ids this far past the newest call this worker was sent may come
MAX_EARLY = 8  # messages that may wait for steps which have not asked for them


class PipelineReceiver:
    def __init__(
        self,
        ctx: zmq.Context,
        bind_address: str,
        rank: int,
        max_message_bytes: int = -1,
        keys: WorkerKeys | None = None,
    ) -> None:
        """max_message_bytes: the largest frame a peer may send (-1: no bound); keys:
        the socket is a CURVE server with the run's worker keys (tcp)."""
        self.rank = rank
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if keys is not None:
            make_server(self.sock, keys.public, keys.secret)
        if bind_address.startswith("tcp://") and bind_address.endswith(":*"):
            port = self.sock.bind_to_random_port(bind_address[: -len(":*")])
            self.address = f"{bind_address[: -len(':*')]}:{port}"
        else:
            self.sock.bind(bind_address)
            self.address = bind_address
        self.drops = DropCounter(log, f"pipeline messages at rank {rank}")
        self._dec = Decoder()
        self._shm = ShmReceiver()
        self._slots: dict[int, PendingTensors] = {}
        self._leases: dict[int, ShmLease] = {}  # shared tensors held until forget()
        self._lock = threading.Lock()
        self._run_id = ""  # none yet: nothing is taken before the Welcome
        self._src_rank = -1
        self._floor = 0  # every step with an id up to this one is over
        self._newest_call = 0
        self._async: AsyncSocket | None = None

    @property
    def dropped_messages(self) -> int:
        return self.drops.total

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._async = AsyncSocket(self.sock, loop, self._on_message)

    def admit(self, run_id: str, src_rank: int) -> None:
        """From now on take this run's messages from src_rank (the previous stage)."""
        with self._lock:
            self._run_id, self._src_rank = run_id, src_rank

    def note_call(self, call_id: int) -> None:
        """This worker has been sent call_id: its tensors may come."""
        if call_id > self._newest_call:
            self._newest_call = call_id

    def expect(self, call_id: int, src_rank: int, timeout_s: float | None = None) -> PendingTensors:
        """The slot of call_id's tensors, asked for as the step starts. Every earlier
        call is over by then (calls run in the order of their ids): tensors that came for
        one that never asked (a call refused before it ran) go back."""
        self.note_call(call_id)
        until = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            stale = self._raise_floor(call_id - 1)
            slot = self._slots.get(call_id)
            if slot is None:
                slot = self._slots[call_id] = PendingTensors(call_id, src_rank, until)
            else:  # the tensors came first
                slot.src_rank, slot.until = src_rank, until
            slot.expected = True
        for lease in stale:
            lease.release()
        return slot

    def forget(self, call_id: int) -> None:
        """The step is over (any thread): its shared tensors go back to their sender, and
        tensors that come for it later are dropped on arrival."""
        with self._lock:
            self._slots.pop(call_id, None)
            lease = self._leases.pop(call_id, None)
            stale = self._raise_floor(call_id)
        for held in [lease, *stale] if lease is not None else stale:
            held.release()

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

    # arrivals (on the event loop) -------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = self._dec.decode(frames)
        except ProtocolError as e:
            self.drops.count(f"did not decode: {e}")
            return
        if not isinstance(msg, PipelineTensors | PipelineSharedTensors | PipelineStepRefused):
            self.drops.count(f"a {type(msg).__name__} is no pipeline message")
            return
        with self._lock:
            refused = self._refusal(msg)
        if refused is not None:
            self.drops.count(f"call {msg.call_id} from rank {msg.src_rank}: {refused}")
            if isinstance(msg, PipelineSharedTensors) and self._of_this_run(msg):
                self._give_back(msg)
            return
        if isinstance(msg, PipelineTensors):
            self._arrived(msg.call_id, msg.src_rank, msg.tensors, None)
        elif isinstance(msg, PipelineStepRefused):
            refused = RuntimeError(
                f"step {msg.call_id}: the previous stage (rank {msg.src_rank}) refused it: "
                f"{msg.reason}"
            )
            self._arrived(msg.call_id, msg.src_rank, None, refused)
        else:
            self._open_shared(msg)

    def _of_this_run(self, msg: PipelineMessage) -> bool:
        return bool(self._run_id) and hmac.compare_digest(msg.run_id, self._run_id)

    def _refusal(self, msg: PipelineMessage) -> str | None:
        """Why msg is turned away (under the lock), or None."""
        if not self._run_id:
            return "no run admitted yet"
        if not self._of_this_run(msg):
            return "not this run's"
        if msg.src_rank != self._src_rank:
            return f"rank {self._src_rank} is the previous stage"
        if msg.call_id <= self._floor:
            return "its step is over"
        if msg.call_id > self._newest_call + MAX_AHEAD:
            return f"too far past the newest call ({self._newest_call})"
        slot = self._slots.get(msg.call_id)
        if slot is not None and slot.arrived:
            return "its tensors came already"
        early = sum(1 for s in self._slots.values() if not s.expected)
        if slot is None and early >= MAX_EARLY:
            return f"{MAX_EARLY} messages already wait for their steps"
        return None

    def _give_back(self, msg: PipelineSharedTensors) -> None:
        """The slot a turned-away message of this run names goes back to its sender."""
        try:
            self._shm.open(msg.shared).release()
        except (ShmDescriptorError, OSError) as e:
            log.debug("rank %d: a refused message's slot could not be returned: %s", self.rank, e)

    def _open_shared(self, msg: PipelineSharedTensors) -> None:
        """Map the tensors in place; a descriptor that cannot be used fails its step."""
        shared = msg.shared
        try:
            lease = self._shm.open(shared)
        except ShmDescriptorError as e:
            self.drops.count(f"a bad shared-memory descriptor from rank {msg.src_rank}: {e}")
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
            if call_id <= self._floor:  # its step ended meanwhile
                stale = True
            else:
                stale = False
                slot = self._slots.get(call_id)
                if slot is None:  # arrived before its step: kept for expect()
                    slot = self._slots[call_id] = PendingTensors(call_id, src_rank, None)
                if lease is not None:
                    self._leases[call_id] = lease
                if error is not None:
                    slot.fail(error)
                else:
                    assert tensors is not None
                    slot.deliver(tensors)
        if stale and lease is not None:
            lease.release()

    def _raise_floor(self, call_id: int) -> list[ShmLease]:
        """Steps up to call_id are over (under the lock): the tensors kept for any of them
        that never asked go; their leases are returned, to be released."""
        if call_id <= self._floor:
            return []
        self._floor = call_id
        stale = [i for i in self._slots if i <= call_id]
        for i in stale:
            del self._slots[i]
        return [self._leases.pop(i) for i in stale if i in self._leases]
