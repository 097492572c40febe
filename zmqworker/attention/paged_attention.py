"""Paged attention in plain torch: write this step's keys/values through the slot mapping,
then attend each request's queries to its whole history, read through its block table.

The history is gathered block by block (index_select over whole blocks) into a workspace
that is reused across layers and steps: allocating fresh multi-megabyte buffers per layer
costs page faults that dominate decode on CPU. Attention itself is
torch.nn.functional.scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zmqworker.attention.metadata import AttentionMetadata

# (device, dtype) -> flat buffer, grown on demand, viewed as [2, blocks, block elements].
_workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_WORKSPACE_ROUND = 1 << 20  # elements; growth granularity


def _gather_buffer(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A contiguous [2, num_blocks, block elements] view of the reusable workspace."""
    block_elems = kv_cache[0, 0].numel()
    needed = 2 * num_blocks * block_elems
    key = (kv_cache.device, kv_cache.dtype)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < needed:
        size = -(-needed // _WORKSPACE_ROUND) * _WORKSPACE_ROUND
        buf = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
        _workspaces[key] = buf
    return buf[:needed].view(2, num_blocks, block_elems)


def release_workspaces() -> None:
    """Free the gather workspaces (e.g. before sleeping or measuring memory)."""
    _workspaces.clear()


def _check_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, query: torch.Tensor, meta: AttentionMetadata
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[2] != meta.block_size
        or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"KV cache shape {tuple(kv_cache.shape)} is not [2, num_blocks, "
            f"{meta.block_size}, {num_kv_heads}, {head_dim}]"
        )
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"KV cache dtype {kv_cache.dtype} differs from the model's {query.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache tensor must be contiguous")


def _gather_history(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every request, [num_reqs, num_kv_heads, key_len, head_dim] views."""
    num_blocks, _, num_kv_heads, head_dim = kv_cache.shape[1:]
    buf = _gather_buffer(kv_cache, meta.gather_block_ids.numel())
    # Row selects along dim 0 of 2-D views: torch copies whole rows, near memcpy speed.
    torch.index_select(kv_cache[0].view(num_blocks, -1), 0, meta.gather_block_ids, out=buf[0])
    torch.index_select(kv_cache[1].view(num_blocks, -1), 0, meta.gather_block_ids, out=buf[1])
    shape = (2, meta.num_reqs, meta.num_gather_blocks * meta.block_size, num_kv_heads, head_dim)
    history = buf.view(shape)[:, :, : meta.key_len].transpose(2, 3)
    return history[0], history[1]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
    head_dim] of this step; kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]."""
    _check_cache(kv_cache, key, query, meta)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
    gqa = num_heads != num_kv_heads

    if meta.is_single_fresh_prefill:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)

    keys, values = _gather_history(kv_cache, meta)
    if meta.is_decode_only:
        # One query per request: the query heads sharing a kv head become that head's query
        # rows, so SDPA runs on the kv heads without repeating keys.
        group = num_heads // num_kv_heads
        packed = query.reshape(meta.num_reqs, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            packed, keys, values, attn_mask=meta.attn_mask, scale=scale
        )
        return out.reshape(num_tokens, num_heads, head_dim)

    if meta.query_pad_index is not None:
        query = query.index_select(0, meta.query_pad_index)
    grid = query.reshape(meta.num_reqs, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        grid, keys, values, attn_mask=meta.attn_mask, scale=scale, enable_gqa=gqa
    )
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    if meta.query_unpad_index is not None:
        out = out.index_select(0, meta.query_unpad_index)
    return out
