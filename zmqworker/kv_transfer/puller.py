"""The decode side's puller: for each load, ask the prefill ranks its head map names
(head_map.py: the rank of the same tp rank where the sizes match) for their heads of the
request's staged KV and hand each piece that comes back to the worker's thread, which
copies it into the request's blocks; then say KVDone, so the prefill side lets it go. A
refused pull, or an answer this rank cannot use, fails the load and says KVDone at once.

One thread owns every socket (a CURVE DEALER per prefill address, the deployment's KV
keys). A load not answered within the timeout fails, naming the request and the address,
and its late answer is dropped: nothing waits unbounded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from messages.kv_peer import KVBlocks, KVDone, KVLayout, KVPull
from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.blocks import staged_nbytes
from zmqworker.kv_transfer.head_map import HeadMap, HeadSource
from zmqworker.kv_transfer.staging import PeerMappings, SharedMemoryError
from zmqworker.transport.curve import KVKeys
from zmqworker.transport.frames import recv_frames, send_frames
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.kv_transfer")


@dataclass
class Arrived:
    """A piece of a load's KV from one source, ready to copy into its blocks (buffer:
    [layers, 2, n, heads, slots] bytes of layout, the load's blocks from first_block on;
    the source's heads start at head first of it), or why it failed (error)."""

    load: KVLoad
    source: HeadSource
    buffer: Any = None  # a zmq frame's buffer or a view of a peer's memfd mapping
    keep: list[Any] = field(default_factory=list)  # what the buffer lives in
    error: str | None = None
    layout: KVLayout | None = None
    first: int = 0
    first_block: int = 0
    unhold: Callable[[], None] | None = None  # lets the mapping the buffer is in go

    def release(self) -> None:
        """Nothing reads the buffer any more (its copies are done)."""
        self.keep.clear()
        self.buffer = None
        if self.unhold is not None:
            self.unhold, unhold = None, self.unhold
            unhold()


class KVPuller:
    def __init__(
        self,
        rank: int,
        layout: KVLayout,
        keys: KVKeys | None,
        timeout_s: float,
        shm: bool,
        on_arrival: Callable[[], None],
        device: torch.device | None,
    ) -> None:
        """on_arrival() is called (on the puller's thread) after each arrival. device:
        the GPU the KV is copied into (the mappings of producers' memfds are page-locked
        for it), or None."""
        self.rank = rank
        self._on_arrival = on_arrival
        self.num_pulled = {"memfd": 0, "tcp": 0}  # loads that came, by their path
        # Their payload bytes: over tcp the data frames received; through the memfd the
        # staged bytes the copy reads (the blocks after the cached ones, the heads taken).
        self.num_bytes = {"memfd": 0, "tcp": 0}
        self.layout = layout
        self.timeout_s = timeout_s
        self._keys = keys
        self._host_id = wire.boot_id() if shm else ""
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._mappings = PeerMappings(device)
        self._orders: queue.SimpleQueue[tuple[str, KVLoad, HeadSource]] = queue.SimpleQueue()
        self.arrived: queue.SimpleQueue[Arrived] = queue.SimpleQueue()
        self._wake = WakePipe()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self._thread.start()

    def pull(self, load: KVLoad, heads: HeadMap) -> None:
        """Pull load's KV from heads' reads (one Arrived each), release heads' releases."""
        for source in heads.reads:
            self._orders.put(("pull", load, source))
        for source in heads.releases:
            self._orders.put(("release", load, source))
        self._wake.wake()

    def done(self, load: KVLoad, source: HeadSource) -> None:
        """The worker copied load's KV from source: tell its server."""
        self._orders.put(("done", load, source))
        self._wake.wake()

    def close(self) -> None:
        self._stop = True
        self._wake.wake()
        self._thread.join(timeout=10.0)
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()
        self._mappings.close()

    # the puller's thread ---------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake.fd, zmq.POLLIN)
        # (address, remote req_id) -> (load, source, deadline)
        waiting: dict[tuple[str, str], tuple[KVLoad, HeadSource, float]] = {}
        try:
            while not self._stop:
                timeout = -1
                if waiting:
                    soonest = min(deadline for _, _, deadline in waiting.values())
                    timeout = max(0, int((soonest - time.monotonic()) * 1000) + 1)
                events = dict(poller.poll(timeout))
                if self._wake.fd in events:
                    self._wake.drain()
                    self._take_orders(poller, waiting)
                for address, sock in self._socks.items():
                    if events.get(sock):
                        self._receive(address, sock, waiting)
                now = time.monotonic()
                for key, (load, source, deadline) in list(waiting.items()):
                    if deadline <= now:
                        del waiting[key]
                        error = f"no answer from {key[0]} within {self.timeout_s} s"
                        self._fail(load, source, error)
        except Exception:
            log.exception("rank %d: the KV puller stopped", self.rank)
            for load, source, _ in waiting.values():
                self._fail(load, source, "the KV puller stopped")

    def _take_orders(self, poller: zmq.Poller, waiting: dict) -> None:
        while True:
            try:
                kind, load, source = self._orders.get_nowait()
            except queue.Empty:
                return
            address = load.remote.addresses[source.rank]
            sock = self._socket(address, poller)
            if kind == "pull":
                deadline = time.monotonic() + self.timeout_s
                waiting[(address, load.remote.req_id)] = (load, source, deadline)
            if kind == "done":
                send_frames(sock, [wire.encode(KVDone(load.remote.req_id))])
            else:
                send_frames(sock, [wire.encode(self._pull_of(load, source, self._host_id))])

    @staticmethod
    def _pull_of(load: KVLoad, source: HeadSource, host_id: str) -> KVPull:
        heads = (source.first, source.count)
        whole = heads == (0, source.staged_heads)
        return KVPull(load.remote.req_id, source.rank, host_id,
                      None if whole else heads, source.readers,
                      first_block=load.num_cached_blocks)  # fmt: skip

    def _socket(self, address: str, poller: zmq.Poller) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self._keys is not None:
                self._keys.make_client(sock)
            sock.connect(address)
            poller.register(sock, zmq.POLLIN)
            self._socks[address] = sock
        return sock

    def _receive(self, address: str, sock: zmq.Socket, waiting: dict) -> None:
        while True:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
            try:
                reply = wire.decode(frames[0].buffer)
            except wire.PeerProtocolError as e:
                log.warning("rank %d: from %s: %s", self.rank, address, e)
                continue
            if not isinstance(reply, KVBlocks):
                continue
            entry = waiting.pop((address, reply.req_id), None)
            if entry is None:
                continue  # the answer to a pull that timed out
            load, source, _ = entry
            try:
                arrived = self._unpack(load, source, reply, frames[1:])
            except (OSError, SharedMemoryError) as e:
                # This host's /proc does not show the server (another pid namespace):
                # the bytes come over tcp from now on.
                log.info("rank %d: no shared memory with %s (%s): tcp", self.rank, address, e)
                self._host_id = ""
                waiting[(address, reply.req_id)] = entry
                send_frames(sock, [wire.encode(self._pull_of(load, source, ""))])
                continue
            except Exception as e:
                arrived = self._failed(load, source, f"from {address}: {e}")
            if arrived.error is not None:
                # Refused, or an answer this rank cannot use: it will not read, so the
                # server may let the staging go now rather than when it expires.
                send_frames(sock, [wire.encode(KVDone(load.remote.req_id))])
            self._arrive(arrived)

    def _unpack(
        self, load: KVLoad, source: HeadSource, reply: KVBlocks, frames: list[zmq.Frame]
    ) -> Arrived:
        if reply.error is not None:
            return Arrived(load, source, error=reply.error)
        staged = msgspec.structs.replace(self.layout, num_kv_heads=source.staged_heads)
        if reply.layout != staged:
            raise ValueError(f"the prefill's KV layout {reply.layout} differs from {staged}")
        if reply.num_blocks != len(load.block_ids):
            raise ValueError(
                f"{reply.num_blocks} blocks staged for {len(load.block_ids)} blocks here"
            )
        if reply.first_block > load.num_cached_blocks:
            raise ValueError(
                f"the answer holds the staged blocks from {reply.first_block} on, this "
                f"load needs them from {load.num_cached_blocks} on"
            )
        wanted = msgspec.structs.replace(self.layout, num_kv_heads=source.count)
        if reply.shared is not None:
            shared = reply.shared
            nbytes = staged_nbytes(staged, reply.num_blocks)
            if shared.nbytes != nbytes or reply.first_block != 0:
                raise ValueError(
                    f"{shared.nbytes} bytes staged from block {reply.first_block} on, "
                    f"{nbytes} expected from block 0 on"
                )
            mapping = self._mappings.acquire(shared.pid, shared.fd, nbytes)
            self.num_pulled["memfd"] += 1
            read = reply.num_blocks - load.num_cached_blocks
            self.num_bytes["memfd"] += staged_nbytes(wanted, read)
            view = memoryview(mapping.memory)[:nbytes]
            return Arrived(load, source, view, layout=staged, first=source.first,
                           unhold=lambda: self._mappings.release(mapping))  # fmt: skip
        nbytes = staged_nbytes(wanted, reply.num_blocks - reply.first_block)
        got = [len(f.buffer) for f in frames]
        if got != [nbytes]:
            raise ValueError(
                f"expected one frame of {nbytes} bytes after KVBlocks (heads "
                f"[{source.first}, {source.first + source.count}) of staged blocks "
                f"{reply.first_block} to {reply.num_blocks}), got frames of {got}"
            )
        self.num_pulled["tcp"] += 1
        self.num_bytes["tcp"] += nbytes
        return Arrived(load, source, frames[0].buffer, [frames[0]], layout=wanted,
                       first_block=reply.first_block)  # fmt: skip

    @staticmethod
    def _failed(load: KVLoad, source: HeadSource, error: str) -> Arrived:
        return Arrived(load, source, error=f"KV of request {load.req_id!r}: {error}")

    def _fail(self, load: KVLoad, source: HeadSource, error: str) -> None:
        self._arrive(self._failed(load, source, error))

    def _arrive(self, arrived: Arrived) -> None:
        self.arrived.put(arrived)
        self._on_arrival()
