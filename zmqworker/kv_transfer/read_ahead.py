"""A decode rank's copies made ahead of their answers. Where a load names the prefill's
block ids (RemoteKV.block_ids) and that producer's cache is open here from an earlier
pull (peer_caches.py), the blocks are copied as soon as the step's pulls have gone out,
so that the round trip to the producer runs beside the copy (on a GPU, beside its
launch).

The answer judges each copy. It stands where the answer lends the same opening of the
producer's cache and the same block ids, and the copy ended (on a GPU: was queued)
within half the answer's hold (Arrived.stale). Sound, because the prefill's engine holds
a finished prefill's blocks from its end, before any decode side hears of it, until its
KV is reported taken, and names each staging uniquely (engine/kv_connector.py): an
answer lending the staging by that name says it has not been taken, so its blocks held
that KV all through the copy. Otherwise the answer is taken as if nothing had been
copied (its blocks copied in, or its error failing the load); the load's blocks are
read by nothing before then. A copy ahead holds the opening it reads only until it has
run; on a GPU the puller's thread lets it go (copies_run.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer.arrived import Arrived
from zmqworker.kv_transfer.blocks import copy_from_peer
from zmqworker.kv_transfer.head_map import HeadSource
from zmqworker.kv_transfer.peer_caches import PeerCache, checked_ids
from zmqworker.kv_transfer.puller import KVPuller

log = logging.getLogger("zmqworker.kv_transfer")
# How long the worker's thread waits for the puller to send the step's pulls before
# copying: a GPU copy's launch (and a host copy in slices) holds the GIL, which would
# keep them in.
SEND_WAIT_S = 0.005


@dataclass
class Ahead:
    """A piece of a load copied ahead: the opening of the cache it read (held only until
    the copy has run: the answer names the opening it lends, and this one stands only if
    it is the same), when the copy ended (on a GPU: was queued), and on a GPU the event
    of its end."""

    load: KVLoad
    cache: PeerCache
    copied_at: float
    copied: torch.cuda.Event | None


class ReadAhead:
    def __init__(
        self, puller: KVPuller, kv_caches: Callable[[], list[torch.Tensor]], num_kv_heads: int
    ) -> None:
        """num_kv_heads: this rank's."""
        self._puller = puller
        self._kv_caches = kv_caches
        self._num_kv_heads = num_kv_heads
        self._ahead: dict[tuple[int, HeadSource], Ahead] = {}  # by (id(load), source)
        self.num_copied = 0  # pieces copied ahead, since start
        self.num_stood = 0  # of those, the pieces whose copy stood

    def start(self, pulled: list[tuple[KVLoad, tuple[HeadSource, ...]]]) -> None:
        """Copy the pieces of the loads just pulled (each with its sources) whose
        producers' caches are open here, once the pulls have gone out."""
        peer_caches = self._puller.peer_caches
        pieces = []  # each with the cache open for it as its pull went out, held
        try:
            for load, sources in pulled:
                ids, start = load.remote.block_ids, load.num_cached_blocks
                if ids is None or start >= len(load.block_ids) or len(ids) != len(load.block_ids):
                    continue  # nothing to copy, or block ids an answer could not match either
                for source in sources:
                    address = load.remote.addresses[source.rank]
                    if self._puller.reads_in_place(address):
                        cache = peer_caches.acquire_open(address)
                        if cache is not None:
                            pieces.append((load, source, cache))
            if pieces:
                self._puller.wait_sent(SEND_WAIT_S)
            while pieces:
                self._copy(*pieces.pop(0))
        finally:
            for _, _, cache in pieces:  # not copied from (an error on the way)
                peer_caches.release(cache, used=False)

    def stood(self, arrived: Arrived, timeout_s: float) -> Ahead | None:
        """arrived's copy made ahead, if it stands by arrived (the answer; timeout_s:
        this side's, as Arrived.stale's); else None, and arrived is to be taken as if
        nothing had been copied. One that stands is let go by done."""
        ahead = self._ahead.pop((id(arrived.load), arrived.source), None)
        if ahead is None:
            return None
        stands = (
            arrived.error is None
            and arrived.sources is ahead.cache
            and arrived.source_ids is not None
            and np.array_equal(arrived.source_ids, ahead.load.remote.block_ids)
            and arrived.stale(timeout_s, at=ahead.copied_at) is None
        )
        if stands:
            self.num_stood += 1
            return ahead
        return None

    def done(self, arrived: Arrived, ahead: Ahead) -> None:
        """Let arrived go and say KVDone, once ahead's copy (which stood) has run."""
        self._puller.done_once_run(ahead.copied, arrived)

    def cancel(self, load: KVLoad) -> None:
        """Forget load's copies ahead (it was cancelled: its answers may never come)."""
        for key in [key for key in self._ahead if key[0] == id(load)]:
            del self._ahead[key]

    def close(self) -> None:
        self._ahead.clear()

    def _copy(self, load: KVLoad, source: HeadSource, cache: PeerCache) -> None:
        assert load.remote.block_ids is not None
        kv_caches = self._kv_caches()
        device, start, ids = kv_caches[0].device, load.num_cached_blocks, load.remote.block_ids
        try:
            if cache.num_kv_heads != source.staged_heads:
                raise ValueError(f"{cache.num_kv_heads} heads open, {source.staged_heads} staged")
            source_ids = checked_ids(ids.tolist(), len(ids), cache.num_blocks)[start:]
            dest = np.asarray(load.block_ids[start:], np.int64)
            heads = source.heads(cache.num_kv_heads, self._num_kv_heads)
            taken, mine = source.layer_slices(len(kv_caches))
            copied = copy_from_peer(kv_caches[mine], dest, cache, source_ids, heads, taken)
        except BaseException as e:  # the answer will say where the blocks are
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self._puller.peer_caches.release(cache, used=False)
            if not isinstance(e, Exception):
                raise
            level = logging.DEBUG if isinstance(e, ValueError) else logging.WARNING
            log.log(level, "rank %d: no copy ahead for %r: %s", self._puller.rank, load.req_id, e)
            return
        self._ahead[(id(load), source)] = Ahead(load, cache, time.monotonic(), copied)
        self.num_copied += 1
        # Not a use of the cache: an answer lending it, when this copy stands, is one (an
        # opening that answers no longer lend goes idle, whatever is copied ahead from it).
        caches = self._puller.peer_caches
        self._puller.once_run(copied, lambda: caches.release(cache, used=False))
