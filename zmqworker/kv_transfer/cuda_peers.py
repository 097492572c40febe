"""A prefill rank's GPU cache opened on a decode rank's GPU through CUDA IPC
(ipc_memory.py), for pulls that copy blocks device to device; kept in peer_caches.py's
PeerCaches. The producer's GPU is the decode rank's own or a peer its kernels can read
(NVLink or PCIe peer-to-peer): the copy reads across the link, with no host memory on
the way."""

from __future__ import annotations

import functools
import logging
import math

import torch

from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import CudaKV, KVLayout
from zmqworker.attention.kv_cache import kv_cache_shape
from zmqworker.distributed.cuda_ipc import device_uuid
from zmqworker.distributed.ipc_memory import IpcError, Opened, close_handle, open_handle
from zmqworker.kv_transfer.peer_caches import ALIGN, PeerCache, PeerCacheError

log = logging.getLogger("zmqworker.kv_transfer")


def readable_gpus(device: torch.device) -> list[str]:
    """The GPUs whose caches device's kernels can read: its own, then every visible GPU
    it has peer access to."""
    own = device.index or 0
    peers = [i for i in range(torch.cuda.device_count())
             if i != own and torch.cuda.can_device_access_peer(own, i)]  # fmt: skip
    return [device_uuid(i) for i in (own, *peers)]


def cuda_key(cuda: CudaKV) -> tuple:
    """What names one producer's GPU cache: a new one has other handles or offsets."""
    return (cuda.num_cache_blocks, *((layer.handle, layer.offset) for layer in cuda.layers))


def open_gpu_cache(cuda: CudaKV, layout: KVLayout, device: torch.device) -> PeerCache:
    """The cache cuda names (of layout: the producer's heads) opened on device; ValueError
    where the answer does not fit it, PeerCacheError where it cannot be opened here."""
    if len(cuda.layers) != layout.num_layers:
        raise ValueError(f"{len(cuda.layers)} layers of GPU cache for {layout.num_layers}")
    shape = kv_cache_shape(cuda.num_cache_blocks, layout.block_size, layout.num_kv_heads,
                           layout.head_size)  # fmt: skip
    layer_bytes = math.prod(shape) * DTYPE_BYTES[layout.dtype]
    by_handle: dict[bytes, Opened] = {}
    try:
        layers = []
        for layer in cuda.layers:
            opened = by_handle.get(layer.handle)
            if opened is None:
                opened = by_handle[layer.handle] = open_handle(layer.handle, device)
            if layer.offset % ALIGN:
                raise ValueError(f"a cache layer at offset {layer.offset}, not {ALIGN}-aligned")
            if layer.offset + layer_bytes > opened.size:
                raise ValueError(
                    f"a cache layer of {layer_bytes} bytes at offset {layer.offset} of an "
                    f"allocation of {opened.size}"
                )
            layers.append(opened.address + layer.offset)
    except BaseException as e:
        _close_all(list(by_handle.values()), device)
        if isinstance(e, IpcError):
            raise PeerCacheError(str(e)) from e
        raise
    close = functools.partial(_close_all, list(by_handle.values()), device)
    return PeerCache(cuda_key(cuda), layers, cuda.num_cache_blocks, layout.num_kv_heads, close)


def _close_all(openings: list[Opened], device: torch.device) -> None:
    for opened in openings:
        try:
            close_handle(opened, device)
        except IpcError as e:
            log.error("a producer's cache could not be closed: %s", e)
