"""The engine's KV cache configuration, checked against what this rank's layers need."""

from __future__ import annotations

from messages import KVCacheConfig, KVCacheSpec


def check_kv_cache_config(config: KVCacheConfig, spec: KVCacheSpec) -> None:
    """Every layer of this rank has a tensor and a group of this rank's shape; other
    ranks' layers are ignored."""
    sizes = {name: t.size_bytes for t in config.tensors for name in t.shared_by}
    groups = {name: g.spec for g in config.groups for name in g.layer_names}
    for name in spec.layer_names:
        if name not in sizes or name not in groups:
            raise ValueError(f"KV cache config has no tensor or group for layer {name!r}")
        other = groups[name]
        mine = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        theirs = (other.block_size, other.num_kv_heads, other.head_size, other.dtype)
        if mine != theirs:
            raise ValueError(
                f"KV cache config for layer {name!r} has (block_size, kv heads, head size, "
                f"dtype) {theirs}, this rank needs {mine}"
            )
        if sizes[name] < config.num_blocks * spec.page_size_bytes:
            raise ValueError(
                f"KV cache tensor of layer {name!r} has {sizes[name]} bytes, "
                f"{config.num_blocks} blocks need {config.num_blocks * spec.page_size_bytes}"
            )
