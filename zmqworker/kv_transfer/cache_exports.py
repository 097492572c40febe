"""A prefill rank's GPU cache as a puller on its GPU reads it in place: each layer's CUDA
IPC handle and offset (distributed/ipc_memory.py), exported once for each set of cache
tensors (sleep and wake_up make new ones), and the answer that names a staging's blocks
in them. Used on the server's thread; the cache is held by weak references only, so
that it goes when the worker lets it go.
"""

from __future__ import annotations

import weakref

import torch

from messages.kv_peer import CudaKV, CudaKVLayer
from zmqworker.distributed.cuda_ipc import device_uuid
from zmqworker.distributed.ipc_memory import IpcError, export


class CacheExports:
    def __init__(self, device: torch.device) -> None:
        self.gpu = device_uuid(device.index or 0)
        self._exported: tuple[list[weakref.ref], list[CudaKVLayer]] | None = None

    def answer(self, caches: list[torch.Tensor], block_ids: list[int], hold_s: float) -> CudaKV:
        """block_ids of caches, held hold_s from now; IpcError where the cache cannot be
        shared (memory torch did not get from cudaMalloc, say)."""
        return CudaKV(self.gpu, self._layers(caches), caches[0].shape[1], block_ids, hold_s)

    def _layers(self, caches: list[torch.Tensor]) -> list[CudaKVLayer]:
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
