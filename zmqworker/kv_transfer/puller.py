"""The decode side's puller: for each load, ask the prefill ranks its head map names
(head_map.py: the rank of the same tp rank where the sizes match) for their heads of the
request's staged KV and hand each answer to the worker's thread, which copies the piece
into the request's blocks (or judges the copy it made ahead of the answer:
read_ahead.py); then say KVDone, so the prefill side lets it go. On one host a piece
comes as the producer's memfd (mapped here), or as the producer's cache itself and the
request's block ids in it: where this rank's cache is on a GPU and it can open the
producer's (CUDA IPC, cuda_peers.py), or where both caches are in host memory and the
producer's lies in a memfd (host_peers.py). A refused pull, or an answer this rank
cannot use, fails the load and says KVDone at once.

Over tcp (a producer on another host), a large pull, or one of some of the staged
layers, goes as parts of whole layers over several connections (tcp_parts.py); only the
layers taken travel, the first pull's too. One thread owns every socket (peer_sockets.py).
A load not answered within the timeout fails, naming the request and the address; its
first late answer (or part) says KVDone, once whatever the pull's shape (the server counts
readers, not parts), and every late one is dropped. Nothing waits unbounded. A pull that
cannot be sent (an address that cannot be connected, a peer that takes nothing) fails at
once, with every pull waiting on that address, and the thread goes on with the others."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from messages.kv_peer import KVBlocks, KVDone, KVLayout, KVPull
from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.answers import checked_answer, checked_frames, checked_memfd
from zmqworker.kv_transfer.arrived import Arrived
from zmqworker.kv_transfer.blocks import staged_nbytes
from zmqworker.kv_transfer.copies_run import CopiesRun
from zmqworker.kv_transfer.cuda_peers import readable_gpus
from zmqworker.kv_transfer.head_map import HeadMap, HeadSource
from zmqworker.kv_transfer.lent_caches import open_lent
from zmqworker.kv_transfer.peer_caches import PeerCacheError, PeerCaches
from zmqworker.kv_transfer.peer_sockets import PeerSendError, PeerSockets
from zmqworker.kv_transfer.same_host import SameHost
from zmqworker.kv_transfer.staging import PeerMappings, SharedMemoryError
from zmqworker.kv_transfer.tcp_parts import Parts, split
from zmqworker.transport.curve import KVKeys
from zmqworker.transport.frames import TooManyFrames, recv_frames
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.kv_transfer")
# (address, remote req_id) -> (load, source, deadline, its parts where it is split)
Waiting = dict[tuple[str, str], tuple[KVLoad, HeadSource, float, Parts | None]]
COPY_POLL_MS = 1  # how often the thread looks at the device copies under way
IDLE_POLL_MS = 500  # and at the openings of producers' caches, to close the idle ones


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
        cuda_ipc: bool = True,
    ) -> None:
        """on_arrival() is called (on the puller's thread) after each arrival. device:
        the GPU the KV is copied into (the mappings of producers' memfds are page-locked
        for it), or None. cuda_ipc: on one host, offer to read producers' GPU caches
        (on device or a peer of it)."""
        self.rank = rank
        self._on_arrival = on_arrival
        # Loads that came, by path, and their payload bytes: over tcp the data frames
        # received; through the memfd or a producer's cache the bytes the copy reads (the
        # blocks after the cached ones, the heads and layers taken).
        self.num_pulled = {"cuda_ipc": 0, "host_cache": 0, "memfd": 0, "tcp": 0}
        self.num_bytes = dict.fromkeys(self.num_pulled, 0)
        self.layout = layout
        self.timeout_s = timeout_s
        self._same_host = SameHost(shm)
        self._poller = zmq.Poller()  # over the wake pipe and every socket
        self._waiting: Waiting = {}  # the thread's
        self._sockets = PeerSockets(keys, self._poller, lambda: {a for a, _ in self._waiting})
        self._over_tcp: set[str] = set()  # producers that answered with bytes over tcp
        self._device = device
        self._mappings = PeerMappings(device)
        self.peer_caches = PeerCaches()
        cuda = shm and cuda_ipc and device is not None
        self._gpus = readable_gpus(device) if cuda else []
        self._not_in_place: set[str] = set()  # producers whose caches cannot be opened
        self._asked_again: set[tuple[str, str]] = set()  # (address, req_id) asked for bytes
        self._gave_up: dict[tuple[str, str], float] = {}  # timed out, KVDone unsaid: until
        self._orders: queue.SimpleQueue[tuple[str, KVLoad, HeadSource]] = queue.SimpleQueue()
        self._copies = CopiesRun()  # device copies out of producers' caches, watched here
        self.arrived: queue.SimpleQueue[Arrived] = queue.SimpleQueue()
        self._wake = WakePipe()
        self._sent = threading.Event()  # every pull ordered has been sent
        self._ordering = threading.Lock()  # the orders put and _sent cleared, as one
        self._stop = False
        self._dead = False  # the thread ended on an error: pulls fail at once
        self._thread = threading.Thread(target=self._run, name="kv-puller", daemon=True)
        self._thread.start()

    def pull(self, load: KVLoad, heads: HeadMap) -> None:
        """Pull load's KV from heads' reads (one Arrived each), release heads' releases."""
        if self._dead:  # nothing would send it: each piece fails at once
            for source in heads.reads:
                self._fail(load, source, "the KV puller stopped")
            return
        with self._ordering:
            self._sent.clear()
            for kind, sources in (("pull", heads.reads), ("release", heads.releases)):
                for source in sources:
                    self._orders.put((kind, load, source))
        self._wake.wake()

    def wait_sent(self, timeout_s: float) -> None:
        """Wait, at most timeout_s, until the pulls ordered so far are sent."""
        self._sent.wait(timeout_s)

    @property
    def open_addresses(self) -> list[str]:
        """The prefill addresses this rank has sockets to now."""
        return self._sockets.addresses

    def reads_in_place(self, address: str) -> bool:
        """Whether pulls from address may be answered with the producer's cache."""
        return bool(self._same_host.host_id(address)) and address not in self._not_in_place

    def done(self, load: KVLoad, source: HeadSource) -> None:
        """The worker copied load's KV from source: tell its server."""
        self._orders.put(("done", load, source))
        self._wake.wake()

    def done_once_run(self, copied: torch.cuda.Event | None, arrived: Arrived) -> None:
        """arrived's copies out of a producer's cache end at copied (None: done): let
        arrived go and tell its server once it has passed (watched here: no step may come)."""

        def taken() -> None:
            arrived.release()
            self.done(arrived.load, arrived.source)

        self.once_run(copied, taken)

    def once_run(self, copied: torch.cuda.Event | None, then: Callable[[], None]) -> None:
        """then(), on the puller's thread, once copied has passed (None: done, at once)."""
        if copied is None:
            then()
            return
        self._copies.add(copied, then)
        self._wake.wake()

    def close(self) -> None:
        self._stop = True
        self._wake.wake()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            log.error("rank %d: the KV puller did not stop; its openings stay", self.rank)
            return
        self._copies.close()  # nothing reads a producer's cache after
        self._sockets.close()
        self._mappings.close()
        self.peer_caches.close()

    # the puller's thread ---------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
        poller.register(self._wake.fd, zmq.POLLIN)
        waiting = self._waiting
        try:
            while not self._stop:
                timeout = -1
                if waiting:
                    soonest = min(entry[2] for entry in waiting.values())
                    timeout = max(0, int((soonest - time.monotonic()) * 1000) + 1)
                if self._copies.watched:
                    timeout = COPY_POLL_MS if timeout < 0 else min(timeout, COPY_POLL_MS)
                elif self.peer_caches.any_open or self._sockets.addresses:
                    timeout = IDLE_POLL_MS if timeout < 0 else min(timeout, IDLE_POLL_MS)
                events = dict(poller.poll(timeout))
                if self._wake.fd in events:
                    self._wake.drain()
                    self._take_orders()
                    with self._ordering:
                        if self._orders.empty():  # else woken again, to take the rest
                            self._sent.set()
                self._copies.poll()
                self.peer_caches.close_idle()
                self._sockets.close_idle()
                for address, sock in self._sockets.readable(events):
                    self._receive(address, sock)
                now = time.monotonic()
                for key in [key for key, entry in waiting.items() if entry[2] <= now]:
                    # KVDone on its first late answer: before one, the KV may not be staged
                    self._gave_up[key] = now + self.timeout_s
                    self._give_up(key, f"no answer from {key[0]} within {self.timeout_s} s")
                self._gave_up = {key: t for key, t in self._gave_up.items() if t > now}
        except Exception:
            log.exception("rank %d: the KV puller stopped", self.rank)
            self._dead = True
            for load, source, _, _ in waiting.values():
                self._fail(load, source, "the KV puller stopped")
            while not self._orders.empty():
                kind, load, source = self._orders.get()
                if kind == "pull":
                    self._fail(load, source, "the KV puller stopped")

    def _take_orders(self) -> None:
        waiting = self._waiting
        while True:
            try:
                kind, load, source = self._orders.get_nowait()
            except queue.Empty:
                return
            address = load.remote.addresses[source.rank]
            if kind == "done":
                self._send(address, KVDone(load.remote.req_id))
                continue
            pull, parts = self._pull_of(load, source), None
            if kind == "pull":
                # Split only over tcp, known from a producer's first answer (a window).
                if not self._same_host.host_id(address) or address in self._over_tcp:
                    parts = split(self.layout, load, source)
                elif (parts := split(self.layout, load, source, streams=1)) is not None:
                    pull = msgspec.structs.replace(pull, layers=parts.asked[0])
                deadline = time.monotonic() + self.timeout_s
                waiting[(address, load.remote.req_id)] = (load, source, deadline, parts)
            if parts is None or pull.layers is not None:
                self._send(address, pull)
                continue
            for i, layers in enumerate(parts.asked):  # each over a connection of its own
                part = msgspec.structs.replace(pull, host_id="", gpus=[], host_cache=False,
                                               layers=layers)  # fmt: skip
                if not self._send(address, part, i):
                    break

    def _send(self, address: str, msg: KVPull | KVDone, conn: int = 0) -> bool:
        """msg to address: whether it went. Where it cannot, the pulls waiting on address
        fail (its sockets are closed: their answers would never come)."""
        try:
            self._sockets.send(address, msg, conn)
            return True
        except PeerSendError as e:
            log.warning("rank %d: %s", self.rank, e)
            for key in [key for key in self._waiting if key[0] == address]:
                self._give_up(key, str(e))
            return False

    def _give_up(self, key: tuple[str, str], error: str) -> None:
        """Fail the load waiting on key (address, req_id): nothing here reads it now."""
        load, source, _, _ = self._waiting.pop(key)
        self._asked_again.discard(key)
        self._fail(load, source, error)

    def _pull_of(self, load: KVLoad, source: HeadSource) -> KVPull:
        heads = (source.first, source.count)
        whole = heads == (0, source.staged_heads)
        address = load.remote.addresses[source.rank]
        openable = self.reads_in_place(address)
        return KVPull(load.remote.req_id, source.rank, self._same_host.host_id(address),
                      None if whole else heads, source.readers,
                      first_block=load.num_cached_blocks,
                      gpus=self._gpus if openable else [],
                      host_cache=openable and self._device is None)  # fmt: skip

    def _receive(self, address: str, sock: zmq.Socket) -> None:
        waiting = self._waiting
        while not sock.closed:  # a send that failed closes its address's sockets
            try:  # KVBlocks, then over tcp its bytes in one frame
                frames = recv_frames(sock, max_frames=2)
            except zmq.Again:
                return
            except TooManyFrames as e:  # as an answer that does not decode: its pull times out
                log.warning("rank %d: from %s: dropped %s", self.rank, address, e)
                continue
            received = time.monotonic()
            try:
                reply = wire.decode(frames[0].buffer)
            except wire.PeerProtocolError as e:
                log.warning("rank %d: from %s: %s", self.rank, address, e)
                continue
            if not isinstance(reply, KVBlocks):
                continue
            entry = waiting.pop((address, reply.req_id), None)
            if entry is None:  # an answer (or part) to a pull that timed out: dropped, and
                # the first says KVDone, one a pull (the server counts readers, not parts)
                if self._gave_up.pop((address, reply.req_id), None):  # a refusal's too
                    self._send(address, KVDone(reply.req_id))
                continue
            load, source, _, parts = entry
            if parts is not None and reply.layers is not None:  # else a window's in place
                parts.take(reply, frames[1:])
                if parts.complete:
                    self._parts_arrived(address, load, source, parts, received)
                else:
                    waiting[(address, reply.req_id)] = entry
                continue
            try:
                arrived = self._unpack(address, load, source, reply, frames[1:], received)
            except PeerCacheError as e:
                key = (address, reply.req_id)
                if key in self._asked_again:  # and answered in place again: it fails
                    arrived = self._failed(load, source, f"from {address}: {e}")
                else:
                    # The producer's cache is not this process's to open: its memfd from
                    # now on (an answer to a pull sent before that is asked again too).
                    if address not in self._not_in_place:
                        log.info("rank %d: cannot read the cache of %s in place (%s): memfd",
                                 self.rank, address, e)  # fmt: skip
                    self._not_in_place.add(address)
                    self._asked_again.add(key)
                    waiting[key] = entry
                    self._send(address, self._pull_of(load, source))
                    continue
            except (OSError, SharedMemoryError) as e:
                error = self._same_host.cannot_open(address, e)
                if error is not None:
                    arrived = self._failed(load, source, f"from {address}: {error}")
                else:  # /proc may not show the server (another pid namespace): tcp
                    log.info("rank %d: no shared memory with %s (%s): tcp", self.rank, address, e)
                    waiting[(address, reply.req_id)] = entry
                    self._send(address, self._pull_of(load, source))
                    continue
            except Exception as e:
                arrived = self._failed(load, source, f"from {address}: {e}")
            self._asked_again.discard((address, reply.req_id))
            if arrived.error is not None:
                # Refused, or an answer this rank cannot use: it will not read, so the
                # server may let the staging go now rather than when it expires.
                self._send(address, KVDone(load.remote.req_id))
            self._arrive(arrived)

    def _unpack(self, address: str, load: KVLoad, source: HeadSource, reply: KVBlocks,
                frames: list[zmq.Frame], received: float) -> Arrived:  # fmt: skip
        if reply.error is not None:
            return Arrived(load, source, error=reply.error)
        staged, wanted, piece = checked_answer(self.layout, load, source, reply)
        read = staged_nbytes(piece, reply.num_blocks - load.num_cached_blocks)  # copied bytes
        if reply.cuda is not None or reply.host_cache is not None:
            maps_host = bool(self._same_host.host_id(address)) and self._device is None
            cache, ids, hold_s = open_lent(self.peer_caches, address, reply, staged, self._gpus,
                                           self._device, maps_host,
                                           address in self._not_in_place)  # fmt: skip
            path = "cuda_ipc" if reply.cuda is not None else "host_cache"
            self.num_pulled[path] += 1
            self.num_bytes[path] += read
            return Arrived(load, source, layout=staged, first=source.first, source_ids=ids,
                           received=received, hold_s=hold_s, sources=cache,
                           unhold=lambda: self.peer_caches.release(cache))  # fmt: skip
        if reply.shared is not None:
            shared, nbytes = reply.shared, checked_memfd(reply, staged)
            mapping = self._mappings.acquire(shared.pid, shared.fd, nbytes, shared.inode)
            self._same_host.opened(address)
            self.num_pulled["memfd"] += 1
            self.num_bytes["memfd"] += read
            view = memoryview(mapping.memory)[:nbytes]
            return Arrived(load, source, view, layout=staged, first=source.first,
                           unhold=lambda: self._mappings.release(mapping))  # fmt: skip
        nbytes = checked_frames(reply, frames, wanted, source)
        self._over_tcp.add(address)
        self.num_pulled["tcp"] += 1
        self.num_bytes["tcp"] += nbytes
        return Arrived(load, source, frames[0].buffer, [frames[0]], layout=wanted,
                       first_block=reply.first_block)  # fmt: skip

    def _parts_arrived(
        self, address: str, load: KVLoad, source: HeadSource, parts: Parts, received: float
    ) -> None:
        """Every part of a split pull was answered: the whole arrives, or fails (one KVDone
        for all of its parts)."""
        if parts.error is not None:
            self._send(address, KVDone(load.remote.req_id))
            self._fail(load, source, f"from {address}: {parts.error}")
            return
        self._over_tcp.add(address)
        self.num_pulled["tcp"] += 1
        self.num_bytes["tcp"] += len(parts.buffer)
        self._arrive(Arrived(load, source, parts.buffer, [parts.buffer], layout=parts.layout,
                             first_block=parts.first_block, first_layer=parts.first_layer,
                             received=received))  # fmt: skip

    @staticmethod
    def _failed(load: KVLoad, source: HeadSource, error: str) -> Arrived:
        return Arrived(load, source, error=f"KV of request {load.req_id!r}: {error}")

    def _fail(self, load: KVLoad, source: HeadSource, error: str) -> None:
        self._arrive(self._failed(load, source, error))

    def _arrive(self, arrived: Arrived) -> None:
        self.arrived.put(arrived)
        self._on_arrival()
