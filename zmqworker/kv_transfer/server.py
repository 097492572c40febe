"""The prefill side's server: finished prefills' KV, handed to the decode ranks that pull
it, over tcp, through a memfd (same host), or straight out of the cache (same host: a GPU
cache through CUDA IPC, a host cache through the memfd that holds it).

A thread of its own serves a CURVE ROUTER (the deployment's KV keys; its ZAP handler
admits their public key alone). A finished prefill's KV stays in the blocks that hold
it (the engine keeps them until it hears the request was sent), and is offered by its
block ids once the step that computed it is queued: nothing is copied on the worker's
thread. A puller on another host may split a pull by layers over several connections
(KVPull.layers, tcp_parts.py): the context's I/O threads run their CURVE side by side.
This thread gathers the blocks into a sealed memfd, which every pull over tcp or
through the memfd reads: as soon as they are offered, unless the last pull came from a
puller that reads the cache itself (on this host, able to open the cache's GPU or map
its host cache), else on the first pull that needs bytes. The server reads only blocks
the engine holds for it, so steps go on beside it. A request's KV goes once each of its
pullers (KVPull.readers: several where the decode instance's layout differs, each
taking its heads or layers) says KVDone, or once nobody has taken it within the
timeout: either way it is reported as finished sending, and the engine frees its blocks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from messages.kv_peer import CudaKV, HostCacheKV, KVBlocks, KVDone, KVLayout, KVPull, SharedKV
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.cache_exports import (
    CacheExports,
    GpuCacheExports,
    HostCacheExports,
    NotShareable,
)
from zmqworker.kv_transfer.staged import Staged, StagedBytes
from zmqworker.kv_transfer.tcp_parts import TCP_STREAMS
from zmqworker.transport.curve import KVKeys, make_server, start_zap
from zmqworker.transport.frames import TooManyFrames, recv_frames, send_frames
from zmqworker.transport.host import boot_id
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.kv_transfer")
# A staging answered with its blocks in place is held this many timeouts from the answer
# (the puller copies within half of one): the copy may wait behind its queued steps.
LENT_TIMEOUTS = 4


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
        shared_cache: Callable[[], SharedKVCache | None] = lambda: None,
    ) -> None:
        """on_sent(req_id) is called (on the server's thread) when a request's staged KV
        is gone: pulled, or expired. kv_caches: the rank's cache tensors now. cuda_ipc:
        answer pullers that can open the cache's GPU with its CUDA IPC handles.
        shared_cache: the memfd holding a host cache now (None: the cache is not in
        one), whose pullers on this host map it."""
        self.rank = rank
        self._kv_caches = kv_caches
        device = kv_caches()[0].device
        self._cuda = device if device.type == "cuda" else None
        # In-place reads (None: none, CUDA IPC off, a private host cache, or refused).
        self._exports: CacheExports | None = None
        if self._cuda and cuda_ipc:
            self._exports = GpuCacheExports(device)
        elif self._cuda is None and shared_cache() is not None:
            self._exports = HostCacheExports(shared_cache)
        # Whether the last pull read the cache itself: the next stagings wait for a pull
        # to be gathered (pullers are alike, as a rule).
        self._reads_in_place = self._exports is not None
        self._unready: list[tuple[bytes, KVPull, float]] = []  # in-place pulls, step running
        self._dead = False  # the thread ended on an error: offers are reported sent at once
        self._withdrawn: dict[str, float] = {}  # dropped on withdrawal, until a timeout
        self.layout = layout
        self._on_sent = on_sent
        self._ctx = zmq.Context(io_threads=TCP_STREAMS)
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
        self._host_id = boot_id()
        self._staged: dict[str, Staged] = {}
        self.bytes = StagedBytes(layout, kv_caches)
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
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            dead = self._dead
            if not dead:
                self._incoming.append(Staged(req_id, ids, deadline, ready))
        if dead:
            self._on_sent(req_id)  # nothing would serve it: its blocks may go
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
        if self._thread.is_alive():  # its socket stays rather than go under it
            log.error("rank %d: the KV server did not stop; its socket stays", self.rank)
            return
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
                self._answer_unready()
                self._expire()
        except Exception:
            log.exception("rank %d: the KV server stopped", self.rank)
        finally:
            with self._lock:
                incoming, self._incoming = self._incoming, []
                self._dead = not self._stop
            self._staged.update((staged.req_id, staged) for staged in incoming)
            for req_id, staged in self._staged.items():
                if staged.memfd is not None:
                    staged.memfd.close()
                if self._dead:  # nothing serves it any more: its blocks go (once unread)
                    wait_s = max(0.0, staged.deadline - time.monotonic()) if staged.lent else 0
                    threading.Timer(wait_s, self._on_sent, [req_id]).start()
            self._staged.clear()
            self.bytes.close()

    def _receive_all(self) -> None:
        while True:
            try:  # a peer's identity (a ROUTER's first frame), its KVPull or KVDone
                frames = recv_frames(self._sock, max_frames=2)
            except zmq.Again:
                return
            except TooManyFrames as e:
                log.warning("rank %d: dropped %s", self.rank, e)
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
            wrong = f"a pull meant for rank {pull.rank} reached the KV server of rank {self.rank}"
            self._refuse(peer, pull, wrong)
        elif staged is None and pull.req_id in self._withdrawn:
            self._refuse(peer, pull, self._withdrawal(pull.req_id))
        elif staged is None:
            deadline = time.monotonic() + self._timeout_s
            self._early.setdefault(pull.req_id, []).append((peer, pull, deadline))
        elif staged.withdrawn:
            staged.readers = pull.readers  # so that its KVDone counts among all of them
            self._refuse(peer, pull, self._withdrawal(pull.req_id))
        elif pull.heads is not None and pull.heads[1] == 0:
            staged.readers = pull.readers
            self._reader_done(pull.req_id)  # a release: this reader takes nothing
        elif (error := self._refusal(staged, pull)) is not None:
            staged.readers = pull.readers  # so that its KVDone counts among all of them
            self._refuse(peer, pull, error)
        else:
            staged.readers = pull.readers
            same_host = pull.host_id == self._host_id  # in place whatever layers it asks
            exports = self._exports
            self._reads_in_place = same_host and exports is not None and exports.readable_by(pull)
            if self._reads_in_place:
                if staged.ready is not None and not staged.ready.query():
                    # Its step still runs: answered once it ends.
                    self._unready.append((peer, pull, time.monotonic() + self._timeout_s))
                    return
                try:
                    self._lend(peer, staged)
                    return
                except NotShareable as e:
                    log.warning("rank %d: the cache cannot be read in place (%s): memfds",
                                self.rank, e)  # fmt: skip
                    self._exports, self._reads_in_place = None, False
            try:
                memfd = self.bytes.memfd(staged)
            except Exception as e:
                log.exception("rank %d: could not gather %r", self.rank, pull.req_id)
                self._refuse(peer, pull, f"rank {self.rank}: {e}")
                return
            if same_host:
                inode = os.fstat(memfd.fd).st_ino
                shared = SharedKV(os.getpid(), memfd.fd, self.bytes.nbytes(staged), inode)
                if self._send(peer, KVBlocks(pull.req_id, self.layout, staged.num_blocks, shared)):
                    staged.hold(self._timeout_s)  # an expiry would close it before the open
            else:
                reply = KVBlocks(pull.req_id, self.layout, staged.num_blocks,
                                 first_block=pull.first_block, layers=pull.layers)  # fmt: skip
                self._send(peer, reply, self.bytes.for_tcp(staged, pull))

    def _lend(self, peer: bytes, staged: Staged) -> None:
        """Answer with staged's blocks where they lie (its step has ended), and hold them
        LENT_TIMEOUTS timeouts from now if the answer went out."""
        assert self._exports is not None
        hold_s = LENT_TIMEOUTS * self._timeout_s
        ids = staged.block_ids.tolist()
        answer = self._exports.answer(self._kv_caches(), ids, hold_s)
        cuda = answer if isinstance(answer, CudaKV) else None
        host = answer if isinstance(answer, HostCacheKV) else None
        reply = KVBlocks(staged.req_id, self.layout, len(ids), cuda=cuda, host_cache=host)
        if self._send(peer, reply):
            staged.lent = True
            staged.hold(hold_s)

    def _answer_unready(self) -> None:
        """The pulls to read in place that waited for their step: answered once it has
        ended, refused by name if it has not within the timeout."""
        unready, self._unready = self._unready, []
        for peer, pull, deadline in unready:
            staged = self._staged.get(pull.req_id)
            running = staged is not None and staged.ready is not None and not staged.ready.query()
            if running and time.monotonic() < deadline:
                self._unready.append((peer, pull, deadline))
            elif running:
                error = (f"the step computing {pull.req_id!r} on rank {self.rank} did not "
                         f"end within {self._timeout_s} s")  # fmt: skip
                self._refuse(peer, pull, error)
            else:
                self._answer(peer, pull)

    def _send(self, peer: bytes, reply: KVBlocks, data: memoryview | None = None) -> bool:
        """reply to peer, then data (the KV over tcp) as the frame after it: whether it
        went out."""
        frames = [peer, wire.encode(reply)]
        if data is not None:
            frames.append(data)
        try:
            send_frames(self._sock, frames)
        except zmq.ZMQError as e:
            log.warning("rank %d: could not answer a pull of %r: %s", self.rank, reply.req_id, e)
            return False
        return True

    def _refuse(self, peer: bytes, pull: KVPull, error: str) -> None:
        """Answer pull with why it gets nothing (naming its part, where it is one)."""
        self._send(peer, KVBlocks(pull.req_id, error=error, layers=pull.layers))

    def _withdrawal(self, req_id: str) -> str:
        return f"the KV of request {req_id!r} was withdrawn on rank {self.rank}"

    def _refusal(self, staged: Staged, pull: KVPull) -> str | None:
        """Why pull cannot be answered from staged, or None."""
        if pull.heads is not None and sum(pull.heads) > self.layout.num_kv_heads:
            return f"heads {pull.heads} asked of rank {self.rank}'s {self.layout.num_kv_heads}"
        if pull.first_block > staged.num_blocks:
            return (
                f"first_block {pull.first_block} is past the {staged.num_blocks} blocks "
                f"staged for request {pull.req_id!r} on rank {self.rank}"
            )
        if pull.layers is not None and sum(pull.layers) > self.layout.num_layers:
            return f"layers {pull.layers} asked of rank {self.rank}'s {self.layout.num_layers}"
        return None

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
                self.bytes.pool.give_back(staged.memfd)
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
            self.bytes.memfd(staged)
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
            for peer, pull, _ in self._early.pop(req_id):
                error = f"no KV staged for request {req_id!r} on rank {self.rank} in time"
                self._refuse(peer, pull, error)

    def _next_deadline_ms(self) -> int:
        if self._unready:
            return 1  # a step to see end
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
