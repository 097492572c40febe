"""The prefill side's server: finished prefills' KV, handed to the decode ranks that pull
it, over tcp, through a memfd (same host), or straight out of the GPU cache (same host,
CUDA IPC).

A thread of its own serves a CURVE ROUTER (the deployment's KV keys; its ZAP handler
admits their public key alone). A finished prefill's KV stays in the blocks that hold
it (the engine keeps them until it hears the request was sent), and is offered by its
block ids once the step that computed it is queued: nothing is copied on the worker's
thread. This thread gathers the blocks into a sealed memfd, which every pull over tcp or
through the memfd reads: as soon as they are offered, unless the last pull came from a
puller that reads the cache itself (on this host, able to open the cache's GPU), else on
the first pull that needs bytes. The server reads only blocks the engine holds for it,
so steps go on beside it. A request's KV goes once each of its pullers (KVPull.readers:
several where the decode instance's tensor parallel size differs, each taking its heads)
says KVDone, or once nobody has taken it within the timeout: either way it is reported
as finished sending, and the engine frees its blocks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import CudaKV, CudaKVLayer, KVBlocks, KVDone, KVLayout, KVPull, SharedKV
from zmqworker.distributed.cuda_ipc import device_uuid
from zmqworker.distributed.ipc_memory import IpcError, export
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.blocks import gather, staged_nbytes, view_staged
from zmqworker.kv_transfer.staging import Memfd, MemfdPool
from zmqworker.transport.curve import KVKeys, make_server, start_zap
from zmqworker.transport.frames import recv_frames, send_frames
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.kv_transfer")
# A staging answered with its blocks in place is held this many timeouts from the answer
# (the puller copies within half of one): the copy may wait behind its queued steps.
LENT_TIMEOUTS = 4


@dataclass
class Staged:
    """One request's KV in block_ids of the live cache (complete once ready, on a GPU,
    has passed), and once a pull needed bytes, in the first nbytes of a memfd too; until
    pulled or expired."""

    req_id: str
    block_ids: np.ndarray  # int64
    nbytes: int
    deadline: float
    ready: torch.cuda.Event | None = None
    memfd: Memfd | None = None
    readers: int = 1  # decode ranks that pull it (the pulls say)
    done: int = 0  # of them that said KVDone (or only released it)
    lent: bool = False  # a puller was answered with the blocks in place
    withdrawn: bool = False  # the engine gave up on it: no pull is answered

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVServer:
    """Serves this rank's staged KV at address until close()."""

    def __init__(
        self,
        address: str,
        rank: int,
        layout: KVLayout,
        keys: KVKeys | None,
        on_sent: Callable[[str], None],
        timeout_s: float,
        kv_caches: Callable[[], list[torch.Tensor]],
        cuda_ipc: bool,
    ) -> None:
        """on_sent(req_id) is called (on the server's thread) when a request's staged KV
        is gone: pulled, or expired. kv_caches: the rank's cache tensors now. cuda_ipc:
        answer pullers that can open the cache's GPU with its CUDA IPC handles."""
        self.rank = rank
        self._kv_caches = kv_caches
        device = kv_caches()[0].device
        self._cuda = device if device.type == "cuda" else None
        self._gpu = device_uuid(device.index or 0) if self._cuda and cuda_ipc else None
        # Whether the last pull read the cache itself: the next stagings wait for a pull
        # to be gathered (pullers are alike, as a rule).
        self._reads_in_place = self._gpu is not None
        # The cache's layers as exported (CUDA IPC), for the cache tensors they name.
        self._exported: tuple[list[weakref.ref], list[CudaKVLayer]] | None = None
        self._withdrawn: dict[str, float] = {}  # dropped on withdrawal, until a timeout
        # The gathers into memfds wait on their prefill's step from a stream of their own.
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self.layout = layout
        self._head_bytes = layout.block_size * layout.head_size * DTYPE_BYTES[layout.dtype]
        self._on_sent = on_sent
        self._ctx = zmq.Context()
        self._zap = start_zap(self._ctx, keys.public) if keys is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.router_mandatory = True  # a vanished puller is an error, not a drop
        if keys is not None:
            make_server(self._sock, keys.public, keys.secret)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._release()
            raise RuntimeError(f"rank {rank}: the KV server cannot bind {address}: {e}") from e
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._host_id = wire.boot_id()
        self._staged: dict[str, Staged] = {}
        self.pool = MemfdPool(self._cuda)  # page-locked for the GPU where there is one
        # Pulls that came before their staging (the prefill's next step stages it): held
        # until it does, or until the timeout.
        self._early: dict[str, list[tuple[bytes, KVPull, float]]] = {}
        self._timeout_s = timeout_s
        self._incoming: list[Staged] = []
        self._withdrawals: list[str] = []
        self._lock = threading.Lock()
        self._wake = WakePipe()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def offer(self, req_id: str, block_ids: np.ndarray) -> None:
        """From the worker's thread, after the step that computes req_id's KV in
        block_ids (of the cache) was queued: it may be pulled once that step is done."""
        ready = None
        if self._cuda is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._cuda))
        ids = np.asarray(block_ids, np.int64)
        nbytes = staged_nbytes(self.layout, len(ids))
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            self._incoming.append(Staged(req_id, ids, nbytes, deadline, ready))
        self._wake.wake()

    def withdraw(self, req_id: str) -> None:
        """From the worker's thread: answer no more pulls of req_id; it goes (reported
        sent) at once, or where a puller was answered with its blocks in place, once
        that puller is done or the staging expires."""
        with self._lock:
            self._withdrawals.append(req_id)
        self._wake.wake()

    def close(self) -> None:
        self._stop = True
        self._wake.wake()
        self._thread.join(timeout=10.0)
        self._release()

    # the server's thread -----------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            while not self._stop:
                timeout = self._next_deadline_ms()
                for item, _ in poller.poll(timeout):
                    if item is self._sock:
                        self._receive_all()
                    else:
                        self._wake.drain()
                self._take_incoming()
                self._expire()
        except Exception:
            log.exception("rank %d: the KV server stopped", self.rank)
        finally:
            with self._lock:
                incoming, self._incoming = self._incoming, []
            self._staged.update((staged.req_id, staged) for staged in incoming)
            for req_id, staged in self._staged.items():
                if staged.memfd is not None:
                    staged.memfd.close()
                if not self._stop and not staged.lent:
                    self._on_sent(req_id)  # nothing serves it any more: its blocks may go
            self._staged.clear()
            self.pool.close()

    def _receive_all(self) -> None:
        while True:
            try:
                frames = recv_frames(self._sock)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("rank %d: dropped a message of %d frames", self.rank, len(frames))
                continue
            peer, body = frames[0].bytes, frames[1].buffer
            try:
                msg = wire.decode(body)
            except wire.PeerProtocolError as e:
                log.warning("rank %d: %s", self.rank, e)
                continue
            if isinstance(msg, KVPull):
                self._answer(peer, msg)
            elif isinstance(msg, KVDone):
                self._reader_done(msg.req_id)

    def _answer(self, peer: bytes, pull: KVPull) -> None:
        self._take_incoming()  # a pull may overtake the wake-up of its own staging
        staged = self._staged.get(pull.req_id)
        if pull.rank != self.rank:
            self._send(peer, KVBlocks(pull.req_id, error=self._wrong_rank(pull.rank)))
        elif staged is None and pull.req_id in self._withdrawn:
            error = f"the KV of request {pull.req_id!r} was withdrawn on rank {self.rank}"
            self._send(peer, KVBlocks(pull.req_id, error=error))
        elif staged is None:
            deadline = time.monotonic() + self._timeout_s
            self._early.setdefault(pull.req_id, []).append((peer, pull, deadline))
        elif staged.withdrawn:
            staged.readers = pull.readers  # so that its KVDone counts among all of them
            error = f"the KV of request {pull.req_id!r} was withdrawn on rank {self.rank}"
            self._send(peer, KVBlocks(pull.req_id, error=error))
        elif pull.heads is not None and pull.heads[1] == 0:
            staged.readers = pull.readers
            self._reader_done(pull.req_id)  # a release: this reader takes nothing
        elif (error := self._refusal(staged, pull)) is not None:
            staged.readers = pull.readers  # so that its KVDone counts among all of them
            self._send(peer, KVBlocks(pull.req_id, error=error))
        else:
            staged.readers = pull.readers
            same_host = pull.host_id == self._host_id
            self._reads_in_place = same_host and self._gpu is not None and self._gpu in pull.gpus
            if self._reads_in_place:
                try:
                    self._send(peer, self._cuda_answer(staged))
                    return
                except (IpcError, TimeoutError) as e:
                    # Not shareable (or the step never ended): bytes from now on.
                    log.warning("rank %d: KV not answered in place (%s): memfds", self.rank, e)
                    self._gpu = None
                    self._reads_in_place = False
            try:
                memfd = self._gathered(staged)
            except Exception as e:
                log.exception("rank %d: could not gather %r", self.rank, pull.req_id)
                self._send(peer, KVBlocks(pull.req_id, error=f"rank {self.rank}: {e}"))
                return
            if same_host:
                inode = os.fstat(memfd.fd).st_ino
                shared = SharedKV(os.getpid(), memfd.fd, staged.nbytes, inode)
                self._send(peer, KVBlocks(pull.req_id, self.layout, staged.num_blocks, shared))
            else:
                reply = KVBlocks(pull.req_id, self.layout, staged.num_blocks,
                                 first_block=pull.first_block)  # fmt: skip
                self._send(peer, reply, self._tcp_bytes(staged, pull))

    def _cuda_answer(self, staged: Staged) -> KVBlocks:
        """staged's blocks where they lie, for a puller on this host that can open the
        cache's GPU; held for LENT_TIMEOUTS timeouts from now."""
        assert staged.ready is not None and self._gpu is not None
        deadline = time.monotonic() + self._timeout_s
        while not staged.ready.query():  # the prefill's step
            if time.monotonic() > deadline:
                raise TimeoutError(f"the step computing {staged.req_id!r} did not end")
            time.sleep(50e-6)
        caches = self._kv_caches()
        cuda = CudaKV(self._gpu, self._layers(caches), caches[0].shape[1],
                      staged.block_ids.tolist())  # fmt: skip
        staged.lent = True
        staged.deadline = time.monotonic() + LENT_TIMEOUTS * self._timeout_s
        return KVBlocks(staged.req_id, self.layout, staged.num_blocks, cuda=cuda)

    def _layers(self, caches: list[torch.Tensor]) -> list[CudaKVLayer]:
        """caches' layers as exported: once for each set of cache tensors (sleep and
        wake_up make new ones), held by weak references (the cache goes when the worker
        lets it go)."""
        if self._exported is not None:
            refs, layers = self._exported
            same = len(refs) == len(caches)
            if same and all(r() is c for r, c in zip(refs, caches, strict=True)):
                return layers
        layers = []
        for cache in caches:
            if not cache.is_contiguous():
                raise IpcError(f"a cache layer of strides {cache.stride()} is not contiguous")
            exported = export(cache.data_ptr(), cache.device)
            layers.append(CudaKVLayer(exported.handle, exported.offset))
        self._exported = ([weakref.ref(cache) for cache in caches], layers)
        return layers

    def _gathered(self, staged: Staged) -> Memfd:
        """staged's KV in a memfd: gathered out of the cache on the first call."""
        if staged.memfd is not None:
            return staged.memfd
        memfd = self.pool.take(staged.nbytes)
        try:
            view = view_staged(memoryview(memfd.memory), self.layout, staged.num_blocks)
            ids = torch.from_numpy(staged.block_ids)
            if self._stream is None:
                gather(self._kv_caches(), ids, view)
            else:
                assert staged.ready is not None
                with torch.cuda.device(self._cuda), torch.cuda.stream(self._stream):
                    self._stream.wait_event(staged.ready)
                    gather(self._kv_caches(), ids, view)
            del view
        except BaseException:
            self.pool.give_back(memfd)
            raise
        staged.memfd = memfd
        return memfd

    def _send(self, peer: bytes, reply: KVBlocks, data: memoryview | None = None) -> None:
        """reply to peer, then data (the KV over tcp) as the frame after it."""
        frames = [peer, wire.encode(reply)]
        if data is not None:
            frames.append(data)
        try:
            send_frames(self._sock, frames)
        except zmq.ZMQError as e:
            log.warning("rank %d: could not answer a pull of %r: %s", self.rank, reply.req_id, e)

    def _wrong_rank(self, rank: int) -> str:
        return f"a pull meant for rank {rank} reached the KV server of rank {self.rank}"

    def _refusal(self, staged: Staged, pull: KVPull) -> str | None:
        """Why pull cannot be answered from staged, or None."""
        if pull.heads is not None and sum(pull.heads) > self.layout.num_kv_heads:
            return f"heads {pull.heads} asked of rank {self.rank}'s {self.layout.num_kv_heads}"
        if pull.first_block > staged.num_blocks:
            return (
                f"first_block {pull.first_block} is past the {staged.num_blocks} blocks "
                f"staged for request {pull.req_id!r} on rank {self.rank}"
            )
        return None

    def _tcp_bytes(self, staged: Staged, pull: KVPull) -> memoryview:
        """The staged bytes pull takes: its heads (None: all) of the blocks from
        first_block on. The whole staging goes as it lies, without a copy; a part of it
        as one contiguous copy of that part (skipped blocks cut every layer's run)."""
        assert staged.memfd is not None
        whole = memoryview(staged.memfd.memory)[: staged.nbytes]
        heads = pull.heads or (0, self.layout.num_kv_heads)
        if pull.first_block == 0 and heads == (0, self.layout.num_kv_heads):
            return whole
        rows = np.frombuffer(whole, np.uint8).reshape(
            self.layout.num_layers * 2, staged.num_blocks, self.layout.num_kv_heads,
            self._head_bytes,
        )  # fmt: skip
        part = rows[:, pull.first_block :, heads[0] : sum(heads)]
        return memoryview(np.ascontiguousarray(part).reshape(-1))

    def _reader_done(self, req_id: str) -> None:
        staged = self._staged.get(req_id)
        if staged is not None:
            staged.done += 1
            if staged.done >= staged.readers:
                self._drop(req_id, pulled=True)

    def _drop(self, req_id: str, pulled: bool) -> None:
        """Forget req_id's staged KV: its memfd (if a pull needed one) is reused once its
        puller is done with it (pulled), never after an expiry (a late puller may still
        read it)."""
        staged = self._staged.pop(req_id, None)
        if staged is not None:
            if staged.memfd is not None and pulled:
                self.pool.give_back(staged.memfd)
            elif staged.memfd is not None:
                staged.memfd.close()
            self._on_sent(req_id)

    def _take_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
            withdrawals, self._withdrawals = self._withdrawals, []
        for staged in incoming:
            self._staged[staged.req_id] = staged
            early = self._early.pop(staged.req_id, [])
            if not early and not self._reads_in_place:
                self._gather_ahead(staged)
            for peer, pull, _ in early:
                self._answer(peer, pull)
        for req_id in withdrawals:
            staged = self._staged.get(req_id)  # None: gone already (and reported)
            if staged is not None:
                staged.withdrawn = True
                if not staged.lent:
                    self._drop(req_id, pulled=False)
                    self._withdrawn[req_id] = time.monotonic() + self._timeout_s

    def _gather_ahead(self, staged: Staged) -> None:
        """Gather staged now, before any pull (which will likely need the bytes, as the
        last one did). A failure is left for the first pull to meet again and answer."""
        try:
            self._gathered(staged)
        except Exception:
            log.exception("rank %d: could not gather %r ahead", self.rank, staged.req_id)

    def _expire(self) -> None:
        now = time.monotonic()
        self._withdrawn = {r: t for r, t in self._withdrawn.items() if t > now}
        for req_id in [r for r, s in self._staged.items() if s.deadline <= now]:
            staged = self._staged[req_id]
            if staged.lent:
                log.error("rank %d: KV of %r answered in place was never said taken within %d "
                          "timeouts: its blocks go", self.rank, req_id, LENT_TIMEOUTS)  # fmt: skip
            else:
                log.warning("rank %d: staged KV of %r expired unpulled", self.rank, req_id)
            self._drop(req_id, pulled=False)
        for req_id in [r for r, early in self._early.items() if early[0][2] <= now]:
            for peer, _, _ in self._early.pop(req_id):
                error = f"no KV staged for request {req_id!r} on rank {self.rank} in time"
                self._send(peer, KVBlocks(req_id, error=error))

    def _next_deadline_ms(self) -> int:
        deadlines = [s.deadline for s in self._staged.values()]
        deadlines += [early[0][2] for early in self._early.values()]
        if not deadlines:
            return -1
        soonest = min(deadlines)
        return max(0, int((soonest - time.monotonic()) * 1000) + 1)

    def _release(self) -> None:
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()
