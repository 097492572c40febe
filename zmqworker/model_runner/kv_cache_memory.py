"""Where the runner's KV cache lies: a tensor per layer in the device's memory, or, for
a KV producer on the CPU that serves peers through shared memory, every layer in one
memfd (distributed/shared_cache.py), which a consumer on the same host maps to read a
prefill's blocks in place."""

from __future__ import annotations

import torch

from messages import KVCacheSpec
from messages.kv_transfer import KVTransferConfig
from zmqworker.attention.kv_cache import allocate_kv_cache, kv_cache_shape
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.models.registry import torch_dtype


def new_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """One layer's cache of num_blocks blocks, zeroed."""
    return allocate_kv_cache(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size,
                             torch_dtype(spec.dtype), device)  # fmt: skip


def make_caches(
    spec: KVCacheSpec,
    num_blocks: int,
    device: torch.device,
    kv_transfer: KVTransferConfig | None,
) -> tuple[list[torch.Tensor], SharedKVCache | None]:
    """Every layer's cache of num_blocks blocks, zeroed, and the memfd holding them (or
    None: in the device's memory)."""
    shares = kv_transfer is not None and kv_transfer.produces and kv_transfer.shared_memory
    if shares and device.type == "cpu":
        shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        shared = SharedKVCache(len(spec.layer_names), shape, torch_dtype(spec.dtype))
        return list(shared.layers), shared
    return [new_cache(spec, num_blocks, device) for _ in spec.layer_names], None
