"""A decode rank's openings of prefill ranks' GPU caches (CUDA IPC), for pulls that copy
blocks device to device.

A producer's cache tensors are opened once and kept for its next pulls: opening them
costs far more than a pull's copy. One set is kept a producer address: an answer with
other handles (the producer slept and woke, and made its cache anew) replaces it, so
that the old memory, which an opening keeps from being freed, goes. A set replaced while
a copy still reads it lives on in that copy's arrival until its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch

from messages import WeightSpec
from messages.kv_peer import CudaKV, KVLayout
from zmqworker.distributed.cuda_ipc import CudaOpener


class PeerCudaError(RuntimeError):
    """A producer's cache cannot be opened here (its GPU is not this process's to see)."""


class PeerCaches:
    """Used on one thread (the puller's)."""

    def __init__(self) -> None:
        # address -> (the handles' key, the opener holding them, the layers' tensors)
        self._open: dict[str, tuple[tuple, CudaOpener, list[torch.Tensor]]] = {}

    def open(
        self, address: str, cuda: CudaKV, layout: KVLayout, num_blocks: int
    ) -> tuple[list[torch.Tensor], np.ndarray]:
        """The layers of the cache cuda names (of layout: the producer's heads), and the
        num_blocks block ids in it; ValueError where the answer does not fit them,
        PeerCudaError where the cache cannot be opened here."""
        if len(cuda.layers) != layout.num_layers:
            raise ValueError(f"{len(cuda.layers)} layers of GPU cache for {layout.num_layers}")
        ids = np.asarray(cuda.block_ids, np.int64)
        if len(ids) != num_blocks:
            raise ValueError(f"{len(ids)} block ids in the GPU cache for {num_blocks} blocks")
        if len(ids) and ids.max() >= cuda.num_cache_blocks:
            raise ValueError(
                f"block id {ids.max()} past the producer's {cuda.num_cache_blocks} cache blocks"
            )
        key = (cuda.num_cache_blocks, *((r.handle, r.storage_offset_bytes) for r in cuda.layers))
        held = self._open.get(address)
        if held is not None and held[0] == key:
            return held[2], ids
        self._open.pop(address, None)  # a cache made anew: the old one may go
        shape = [2, cuda.num_cache_blocks, layout.num_kv_heads,
                 layout.block_size * layout.head_size]  # fmt: skip
        try:
            opener = CudaOpener()
            layers = [opener.tensor(ref, WeightSpec(ref.name, layout.dtype, shape))
                      for ref in cuda.layers]  # fmt: skip
        except RuntimeError as e:
            raise PeerCudaError(str(e)) from e
        self._open[address] = (key, opener, layers)
        return layers, ids

    def close(self) -> None:
        self._open.clear()
