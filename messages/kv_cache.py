"""The KV cache contract: workers describe their layers, the engine decides the block count."""

from __future__ import annotations

from typing import Annotated

import msgspec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVCacheSpec(msgspec.Struct, tag=True, frozen=True):
    """One worker's attention layers, all of the same shape (full attention).

    A block holds block_size tokens of one layer's keys and values.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layer_names: list[str]

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]


class KVCacheTensor(msgspec.Struct, tag=True, frozen=True):
    """One allocation of size_bytes, used by the layers it names."""

    size_bytes: int
    shared_by: list[str]


class KVCacheGroup(msgspec.Struct, tag=True, frozen=True):
    """Layers that share one block table."""

    layer_names: list[str]
    spec: KVCacheSpec


class KVCacheConfig(msgspec.Struct, tag=True, frozen=True):
    """The engine's decision: num_blocks blocks for every layer of every worker, and
    num_host_blocks slots of the host tier (a block of every layer of the worker each,
    in host memory; 0: no host tier)."""

    num_blocks: int
    tensors: list[KVCacheTensor]
    groups: list[KVCacheGroup]
    num_host_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0


def make_kv_cache_config(
    specs: list[KVCacheSpec], num_blocks: int, num_host_blocks: int = 0
) -> KVCacheConfig:
    """Merge the workers' specs into one group (one block table for every layer) and one
    tensor per layer of num_blocks blocks. Specs of different shapes are an error: every
    layer of a model shares the scheduler's block ids."""
    if not specs:
        raise ValueError("no KV cache specs: the workers reported no attention layers")
    first = specs[0]
    names: list[str] = []
    for spec in specs:
        shape = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        if shape != (first.block_size, first.num_kv_heads, first.head_size, first.dtype):
            raise ValueError(f"KV cache specs differ: {spec} vs {first}")
        names.extend(n for n in spec.layer_names if n not in names)
    merged = KVCacheSpec(first.block_size, first.num_kv_heads, first.head_size, first.dtype, names)
    tensors = [KVCacheTensor(num_blocks * merged.page_size_bytes, [n]) for n in names]
    groups = [KVCacheGroup(names, merged)]
    return KVCacheConfig(num_blocks, tensors, groups, num_host_blocks)
