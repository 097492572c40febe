"""A producer's answer that lends its cache (KVBlocks.cuda, KVBlocks.host_cache): checked
against what the pull offered to read, and the cache opened (GPU) or mapped (host) here,
held in the puller's PeerCaches."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from messages.kv_peer import KVBlocks, KVLayout
from zmqworker.kv_transfer.cuda_peers import cuda_key, open_gpu_cache
from zmqworker.kv_transfer.host_peers import host_key, open_host_cache
from zmqworker.kv_transfer.peer_caches import PeerCache, PeerCacheError, PeerCaches, checked_ids


def open_lent(
    caches: PeerCaches,
    address: str,
    reply: KVBlocks,
    staged: KVLayout,
    gpus: list[str],
    device: torch.device | None,
    maps_host: bool,
    asked_bytes: bool,
) -> tuple[PeerCache, np.ndarray, float]:
    """The producer's cache at address that reply lends, opened unless it is already,
    and held; the piece's block ids in it; how long the producer holds them. gpus: those
    the pull offered to read (device: this rank's); maps_host: whether it offered to map
    a host cache; asked_bytes: the producer was asked for bytes since (PeerCacheError)."""
    opener: Callable[[], PeerCache]
    if reply.cuda is not None:
        lent, where = reply.cuda, "CUDA memory"
        if not gpus or device is None:
            raise ValueError("an answer in CUDA memory to a pull that did not offer to open it")
        if lent.device_uuid not in gpus:
            raise ValueError(f"an answer in {lent.device_uuid}'s memory, not readable here")
        key, opener = cuda_key(lent), lambda: open_gpu_cache(lent, staged, device)
    else:
        lent, where = reply.host_cache, "a host cache"
        assert lent is not None
        if not maps_host:
            raise ValueError("an answer in a host cache to a pull that did not offer to map it")
        key, opener = host_key(lent), lambda: open_host_cache(lent, staged)
    if asked_bytes:
        raise PeerCacheError(f"an answer in {where} from a producer asked for bytes")
    ids = checked_ids(lent.block_ids, reply.num_blocks, lent.num_cache_blocks)
    return caches.acquire(address, key, opener), ids, lent.hold_s
