"""A host KV cache whose layers lie in one sealed memfd (sealed_memfd.py), so that a KV
consumer of the same host maps it and reads a prefill's blocks where they were computed
(kv_transfer), as a GPU cache is read through CUDA IPC.

The memfd is only ever written by its maker; a peer maps it read-only. Its pages are
the cache's own: a peer's mapping adds no memory while the maker holds the cache, and
keeps it after the maker lets it go until the peer unmaps (which it does once idle).
"""

from __future__ import annotations

import math
import os

import torch

from zmqworker.distributed.sealed_memfd import create_sealed

CACHE_MEMFD_NAME = "zmqworker-kv-cache"
LAYER_ALIGN = 4096  # each layer starts on a page of its own


class SharedKVCache:
    """num_layers cache tensors of shape and dtype (zeroed: a fresh memfd reads as
    zeros) in one memfd, each at offsets[i]; the fd stays open (peers open it through
    /proc/<pid>/fd) until close()."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        layer_bytes = math.prod(shape) * dtype.itemsize
        stride = -(-layer_bytes // LAYER_ALIGN) * LAYER_ALIGN
        self.nbytes = max(stride * num_layers, 1)
        self.fd, memory = create_sealed(CACHE_MEMFD_NAME, self.nbytes)
        try:
            # Every page taken now, as a cache in private memory is (where the host
            # refuses, here and by name, rather than at some step's first touch).
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            os.close(self.fd)
            memory.close()
            raise MemoryError(f"a KV cache of {self.nbytes} bytes in shared memory: {e}") from e
        self.inode = os.fstat(self.fd).st_ino
        self.offsets = [i * stride for i in range(num_layers)]
        flat = torch.frombuffer(memory, dtype=torch.uint8)  # holds the mapping alive
        self.layers = [
            flat[offset : offset + layer_bytes].view(dtype).view(shape) for offset in self.offsets
        ]

    def close(self) -> None:
        """No peer may open it from now on; the memory goes with the last tensor over it
        (here and in the peers' mappings)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
