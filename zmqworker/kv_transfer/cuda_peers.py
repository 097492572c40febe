"""A decode rank's openings of prefill ranks' GPU caches (CUDA IPC, ipc_memory.py), for
pulls that copy blocks device to device.

A producer's cache is opened once and kept for its next pulls: opening costs more than a
pull's copy. An opening keeps the producer's memory from being freed (its sleep would
give back nothing), so one that no copy reads is closed after IDLE_CLOSE_S without use,
and at once where an answer from the same producer names other handles (it made its
cache anew). Acquired on the puller's thread; released on any (the copies' end).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import CudaKV, KVLayout
from zmqworker.attention.kv_cache import kv_cache_shape
from zmqworker.distributed.ipc_memory import IpcError, Opened, close_handle, open_handle

log = logging.getLogger("zmqworker.kv_transfer")
IDLE_CLOSE_S = 2.0
ALIGN = 16  # bytes: a cache tensor's allocation is aligned far beyond, a forged offset not


class PeerCudaError(RuntimeError):
    """A producer's cache cannot be opened here."""


@dataclass
class PeerCache:
    """A producer's cache opened here: each layer's address ([2, num_blocks, heads,
    slots], contiguous), and the copies reading it."""

    key: tuple
    layers: list[int]
    num_blocks: int
    num_kv_heads: int
    opened: list[Opened]
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


class PeerCaches:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._open: dict[str, PeerCache] = {}  # by producer address
        self._retired: list[PeerCache] = []  # replaced while read: closed once unread
        self._lock = threading.Lock()

    def acquire(
        self, address: str, cuda: CudaKV, layout: KVLayout, num_blocks: int
    ) -> tuple[PeerCache, np.ndarray]:
        """The cache cuda names (of layout: the producer's heads), held until release(),
        and the num_blocks block ids in it; ValueError where the answer does not fit
        them, PeerCudaError where the cache cannot be opened here."""
        if len(cuda.layers) != layout.num_layers:
            raise ValueError(f"{len(cuda.layers)} layers of GPU cache for {layout.num_layers}")
        ids = np.asarray(cuda.block_ids, np.int64)
        if len(ids) != num_blocks:
            raise ValueError(f"{len(ids)} block ids in the GPU cache for {num_blocks} blocks")
        if len(ids) and ids.max() >= cuda.num_cache_blocks:
            raise ValueError(
                f"block id {ids.max()} past the producer's {cuda.num_cache_blocks} cache blocks"
            )
        key = (cuda.num_cache_blocks, *((layer.handle, layer.offset) for layer in cuda.layers))
        with self._lock:
            cache = self._open.get(address)
            if cache is not None and cache.key == key:
                cache.users += 1
                return cache, ids
            if cache is not None:  # the producer's cache was made anew
                del self._open[address]
                self._retired.append(cache)
        cache = self._opened(key, cuda, layout)
        log.info("opened the GPU cache of the KV producer at %s (%d layers): its blocks "
                 "are read in place", address, len(cache.layers))  # fmt: skip
        with self._lock:
            cache.users += 1
            self._open[address] = cache
        return cache, ids

    def release(self, cache: PeerCache) -> None:
        """A copy out of cache has run."""
        with self._lock:
            cache.users -= 1
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
            self._close(cache)

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
            self._close(cache)

    def _opened(self, key: tuple, cuda: CudaKV, layout: KVLayout) -> PeerCache:
        shape = kv_cache_shape(cuda.num_cache_blocks, layout.block_size, layout.num_kv_heads,
                               layout.head_size)  # fmt: skip
        layer_bytes = math.prod(shape) * DTYPE_BYTES[layout.dtype]
        by_handle: dict[bytes, Opened] = {}
        try:
            layers = []
            for layer in cuda.layers:
                opened = by_handle.get(layer.handle)
                if opened is None:
                    opened = by_handle[layer.handle] = open_handle(layer.handle, self._device)
                if layer.offset % ALIGN:
                    raise ValueError(f"a cache layer at offset {layer.offset}, not {ALIGN}-aligned")
                if layer.offset + layer_bytes > opened.size:
                    raise ValueError(
                        f"a cache layer of {layer_bytes} bytes at offset {layer.offset} of an "
                        f"allocation of {opened.size}"
                    )
                layers.append(opened.address + layer.offset)
        except BaseException as e:
            self._close_all(list(by_handle.values()))
            if isinstance(e, IpcError):
                raise PeerCudaError(str(e)) from e
            raise
        opened = list(by_handle.values())
        return PeerCache(key, layers, cuda.num_cache_blocks, layout.num_kv_heads, opened)

    def _close(self, cache: PeerCache) -> None:
        self._close_all(cache.opened)

    def _close_all(self, openings: list[Opened]) -> None:
        for opened in openings:
            try:
                close_handle(opened, self._device)
            except IpcError as e:
                log.error("a producer's cache could not be closed: %s", e)
