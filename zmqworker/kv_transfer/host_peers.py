"""A prefill rank's host cache mapped read-only on a decode rank of the same host, from
the memfd that holds it (distributed/shared_cache.py), for pulls that copy its blocks
straight into this rank's host cache; kept in peer_caches.py's PeerCaches.

Nothing is mapped before the answer is checked against the layout it must hold. The
mapping is not populated: a pull touches only its blocks' pages, and a producer's cache
may be far larger than what is ever read of it. Its pages are the producer's own; closing
drops this side's tensors over them, and the mapping goes with the last copy's.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings

import torch

from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import HostCacheKV, KVLayout
from zmqworker.attention.kv_cache import kv_cache_shape
from zmqworker.distributed.sealed_memfd import open_peer
from zmqworker.distributed.shared_cache import CACHE_MEMFD_NAME
from zmqworker.kv_transfer.peer_caches import ALIGN, PeerCache, PeerCacheError
from zmqworker.kv_transfer.staging import SharedMemoryError
from zmqworker.models.registry import torch_dtype


def host_key(host: HostCacheKV) -> tuple:
    """What names one producer's host cache: a new one is another memfd."""
    memfd = host.memfd
    return (memfd.pid, memfd.fd, memfd.inode, memfd.nbytes, host.num_cache_blocks, *host.offsets)


def open_host_cache(host: HostCacheKV, layout: KVLayout) -> PeerCache:
    """The cache host names (of layout: the producer's heads), mapped; ValueError where
    the answer does not fit it, PeerCacheError where it cannot be mapped here."""
    if len(host.offsets) != layout.num_layers:
        raise ValueError(f"{len(host.offsets)} layers of host cache for {layout.num_layers}")
    if not host.memfd.inode:  # a producer's new cache may take the old one's fd number
        raise ValueError("an answer in a host cache that does not name the memfd's inode")
    shape = kv_cache_shape(host.num_cache_blocks, layout.block_size, layout.num_kv_heads,
                           layout.head_size)  # fmt: skip
    layer_bytes = math.prod(shape) * DTYPE_BYTES[layout.dtype]
    memfd = host.memfd
    try:
        fd, size = open_peer(memfd.pid, memfd.fd, CACHE_MEMFD_NAME, SharedMemoryError,
                             "KV cache", writable=False, inode=memfd.inode)  # fmt: skip
    except (OSError, SharedMemoryError) as e:
        raise PeerCacheError(str(e)) from e
    try:
        if size != memfd.nbytes:
            raise ValueError(f"the peer's cache memfd holds {size} bytes, not {memfd.nbytes}")
        for offset in host.offsets:
            if offset % ALIGN:
                raise ValueError(f"a cache layer at offset {offset}, not {ALIGN}-aligned")
            if offset + layer_bytes > size:
                raise ValueError(
                    f"a cache layer of {layer_bytes} bytes at offset {offset} of a memfd of {size}"
                )
        try:
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as e:
            raise PeerCacheError(f"the peer's KV cache cannot be mapped: {e}") from e
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only: the tensors over it are only read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(memory, dtype=torch.uint8)
    dtype = torch_dtype(layout.dtype)
    layers = [flat[o : o + layer_bytes].view(dtype).view(shape) for o in host.offsets]
    return PeerCache(host_key(host), layers, host.num_cache_blocks, layout.num_kv_heads,
                     close=layers.clear)  # fmt: skip
