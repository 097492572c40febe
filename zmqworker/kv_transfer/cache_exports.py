"""A prefill rank's cache as a puller on its host reads it in place, and the answers that
name a staging's blocks in it: a GPU cache through each layer's CUDA IPC handle and
offset (distributed/ipc_memory.py), exported once for each set of cache tensors (sleep
and wake_up make new ones); a host cache through the memfd that holds every layer
(distributed/shared_cache.py). Used on the server's thread; the cache is held by weak
references only, so that it goes when the worker lets it go.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

from messages.kv_peer import CudaKV, CudaKVLayer, HostCacheKV, KVPull, SharedKV
from zmqworker.distributed.cuda_ipc import device_uuid
from zmqworker.distributed.ipc_memory import IpcError, export
from zmqworker.distributed.shared_cache import SharedKVCache


class NotShareable(RuntimeError):
    """The cache cannot be read in place (the pulls get its bytes instead)."""


class GpuCacheExports:
    def __init__(self, device: torch.device) -> None:
        self.gpu = device_uuid(device.index or 0)
        self._exported: tuple[list[weakref.ref], list[CudaKVLayer]] | None = None

    def readable_by(self, pull: KVPull) -> bool:
        """Whether pull's puller can open this GPU (it is on this host)."""
        return self.gpu in pull.gpus

    def answer(self, caches: list[torch.Tensor], ids: list[int], hold_s: float) -> CudaKV:
        """Blocks ids of caches, held hold_s from now."""
        return CudaKV(self.gpu, self._layers(caches), caches[0].shape[1], ids, hold_s)

    def _layers(self, caches: list[torch.Tensor]) -> list[CudaKVLayer]:
        if self._exported is not None:
            refs, layers = self._exported
            same = len(refs) == len(caches)
            if same and all(r() is c for r, c in zip(refs, caches, strict=True)):
                return layers
        layers = []
        for cache in caches:
            if not cache.is_contiguous():
                raise NotShareable(f"a cache layer of strides {cache.stride()} is not contiguous")
            try:
                exported = export(cache.data_ptr(), cache.device)
            except IpcError as e:  # memory torch did not get from cudaMalloc, say
                raise NotShareable(str(e)) from e
            layers.append(CudaKVLayer(exported.handle, exported.offset))
        self._exported = ([weakref.ref(cache) for cache in caches], layers)
        return layers


class HostCacheExports:
    def __init__(self, shared: Callable[[], SharedKVCache | None]) -> None:
        """shared: the memfd holding the rank's cache now."""
        self._shared = shared

    def readable_by(self, pull: KVPull) -> bool:
        """Whether pull's puller can map a host cache (it is on this host)."""
        return pull.host_cache

    def answer(self, caches: list[torch.Tensor], ids: list[int], hold_s: float) -> HostCacheKV:
        """Blocks ids of caches, held hold_s from now."""
        shared = self._shared()
        if shared is None or shared.fd < 0 or len(shared.layers) != len(caches):
            raise NotShareable("the host cache is not in shared memory")
        if any(mine is not cache for mine, cache in zip(shared.layers, caches, strict=True)):
            raise NotShareable("the host cache is not the one in shared memory")
        memfd = SharedKV(os.getpid(), shared.fd, shared.nbytes, shared.inode)
        return HostCacheKV(memfd, shared.offsets, caches[0].shape[1], ids, hold_s)


CacheExports = GpuCacheExports | HostCacheExports
