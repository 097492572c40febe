"""The KV cache's configuration: its dtype from the worker's settings, and the engine's
config checked against what this rank's layers need."""

from __future__ import annotations

from messages import KVCacheConfig, KVCacheSpec


def cache_dtype_name(cache_dtype: str, model_dtype: str) -> str:
    """The KV cache's dtype: the model's ("auto", or the same name)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype != model_dtype:
        raise ValueError(
            f"cache_dtype {cache_dtype!r} differs from the model dtype {model_dtype!r}; the "
            "paged attention needs them equal (use 'auto')"
        )
    return cache_dtype


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
