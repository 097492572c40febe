"""The paged KV cache of one layer: its layout, and writing a step's keys and values into it.

One tensor per layer, [2, num_blocks, num_kv_heads, block_size * head_dim]. Index 0 holds
the keys, each (block, head) stored transposed: head_dim rows of block_size. Index 1 holds
the values, each (block, head) as block_size rows of head_dim. Transposed keys let decode
attention compute a block's scores as one weighted sum of rows (see decode.py).
"""

from __future__ import annotations

import torch


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one layer's cache tensor."""
    return (2, num_blocks, num_kv_heads, block_size * head_dim)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed cache: never-written slots hold finite values, so masked reads stay finite."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def check_kv_cache(
    kv_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Raise ValueError naming what does not fit this layer's keys and values."""
    if (
        kv_cache.dim() != 4
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[2:]) != (num_kv_heads, block_size * head_dim)
    ):
        raise ValueError(
            f"KV cache shape {tuple(kv_cache.shape)} is not [2, num_blocks, {num_kv_heads} kv "
            f"heads, {block_size} block_size * {head_dim} head_dim]"
        )
    if kv_cache.dtype != dtype:
        raise ValueError(f"KV cache dtype {kv_cache.dtype} differs from the model's {dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache tensor must be contiguous")


def key_rows(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys as [num_blocks * num_kv_heads * head_dim, block_size]: row (block, head, d)."""
    return kv_cache[0].view(-1, block_size)


def value_rows(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Values as [num_blocks * num_kv_heads * block_size, head_dim]: row (block, head, slot)."""
    return kv_cache[1].view(kv_cache.shape[1] * kv_cache.shape[2] * block_size, -1)


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store token t's key/value [num_tokens, num_kv_heads, head_dim] at offset
    slot_offsets[t] of block slot_blocks[t]."""
    num_blocks, num_kv_heads = kv_cache.shape[1], kv_cache.shape[2]
    head_dim = key.shape[2]
    block_size = kv_cache.shape[3] // head_dim
    # Both views are [num_blocks, block_size, num_kv_heads, head_dim] over the stored layout.
    keys = kv_cache[0].view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
    values = kv_cache[1].view(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)
    keys.index_put_((slot_blocks, slot_offsets), key)
    values.index_put_((slot_blocks, slot_offsets), value)
