"""A decode rank's openings of prefill ranks' caches, for pulls that read a staging's
blocks where they were computed: a GPU cache opened through CUDA IPC (cuda_peers.py), a
host cache mapped from its memfd (host_peers.py).

A producer's cache is opened once and kept for its next pulls: opening costs more than a
pull's copy. An opening keeps the producer's memory from being freed (its sleep would
give back nothing), so one that no copy reads is closed after IDLE_CLOSE_S without use,
and at once where an answer from the same producer names another cache (it made its
cache anew). Acquired for an answer on the puller's thread, or for a copy ahead of one on
the worker's (read_ahead.py); released on any thread, once the copies have run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("zmqworker.kv_transfer")
IDLE_CLOSE_S = 2.0
ALIGN = 16  # bytes: a cache layer's offset (real ones are aligned far beyond, forged not)


class PeerCacheError(RuntimeError):
    """A producer's cache cannot be opened here (its pulls take bytes instead)."""


@dataclass(eq=False)
class PeerCache:
    """A producer's cache opened here: each layer ([2, num_blocks, heads, slots],
    contiguous) as this side reads it, how to close it, and the copies reading it."""

    key: tuple
    layers: list[Any]  # a GPU cache: each layer's address here; a host cache: a tensor
    num_blocks: int
    num_kv_heads: int
    close: Callable[[], None]
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


def checked_ids(block_ids: list[int], num_blocks: int, num_cache_blocks: int) -> np.ndarray:
    """An answer's block ids in the producer's cache, checked against the load's block
    count and the cache's (ValueError naming what does not fit)."""
    ids = np.asarray(block_ids, np.int64)
    if len(ids) != num_blocks:
        raise ValueError(f"{len(ids)} block ids in the producer's cache for {num_blocks} blocks")
    if len(ids) and ids.max() >= num_cache_blocks:
        raise ValueError(
            f"block id {ids.max()} past the producer's {num_cache_blocks} cache blocks"
        )
    return ids


class PeerCaches:
    def __init__(self) -> None:
        self._open: dict[str, PeerCache] = {}  # by producer address
        self._retired: list[PeerCache] = []  # replaced while read: closed once unread
        self._lock = threading.Lock()

    def acquire(self, address: str, key: tuple, opener: Callable[[], PeerCache]) -> PeerCache:
        """The cache of the producer at address that key names (opener() opens it, unless
        open already), held until release()."""
        with self._lock:
            cache = self._open.get(address)
            if cache is not None and cache.key == key:
                cache.users += 1
                return cache
            if cache is not None:  # the producer's cache was made anew
                del self._open[address]
                self._retired.append(cache)
        cache = opener()
        log.info("opened the cache of the KV producer at %s (%d layers): its blocks are "
                 "read in place", address, len(cache.layers))  # fmt: skip
        with self._lock:
            cache.users += 1
            self._open[address] = cache
        return cache

    def acquire_open(self, address: str) -> PeerCache | None:
        """The cache of the producer at address open here now, if any, held until
        release(): for a copy ahead of that producer's answer, which says whether it is
        still the cache holding the blocks."""
        with self._lock:
            cache = self._open.get(address)
            if cache is not None:
                cache.users += 1
            return cache

    def release(self, cache: PeerCache, used: bool = True) -> None:
        """A copy out of cache has run; used: one that counts as a use of it (a copy
        ahead of an answer that did not stand does not keep it from being idle)."""
        with self._lock:
            cache.users -= 1
            if used:
                cache.last_used = time.monotonic()

    def close_idle(self) -> None:
        """Close what no copy has read for IDLE_CLOSE_S, and what was replaced and is
        unread (from the puller's thread)."""
        now = time.monotonic()
        with self._lock:
            idle = [address for address, cache in self._open.items()
                    if not cache.users and now - cache.last_used > IDLE_CLOSE_S]  # fmt: skip
            gone = [self._open.pop(address) for address in idle]
            gone += [c for c in self._retired if not c.users]
            self._retired = [c for c in self._retired if c.users]
        for cache in gone:
            cache.close()

    @property
    def any_open(self) -> bool:
        with self._lock:
            return bool(self._open or self._retired)

    def close(self) -> None:
        """Close every opening (once no copy reads any)."""
        with self._lock:
            gone = [*self._open.values(), *self._retired]
            self._open.clear()
            self._retired.clear()
        for cache in gone:
            cache.close()
