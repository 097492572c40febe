"""Paged attention in plain torch: write this step's keys/values into the cache through the
slot mapping, then attend each request's queries to its whole history.

Decode requests are attended all together (decode.py). Each prefill request is attended on
its own with SDPA, so that no request pads another: a fresh prompt over its own new keys
(causal, no cache read), a request with cached context over its history gathered from the
cache, in slices of query rows whose mask holds at most PREFILL_MASK_ELEMENTS entries.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from zmqworker.attention.decode import CHUNK_POSITIONS, decode_attention
from zmqworker.attention.kv_cache import check_kv_cache, write_kv
from zmqworker.attention.metadata import AttentionMetadata, PrefillRequest
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv

PREFILL_MASK_ELEMENTS = 1 << 20


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads,
    head_dim] of this step; kv_cache as kv_cache.py lays it out.
    Returns [num_tokens, num_heads, head_dim]."""
    check_kv_cache(kv_cache, meta.block_size, key.shape[1], key.shape[2], query.dtype)
    write_kv(kv_cache, key, value, meta.slot_blocks, meta.slot_offsets)
    decode, prefills = meta.decode, meta.prefills
    workspace = meta.workspace
    if decode is not None and decode.tokens is None:
        return decode_attention(query, kv_cache, decode, scale, workspace)
    if decode is None and len(prefills) == 1:
        return _prefill(query, key, value, kv_cache, prefills[0], scale, workspace)
    out = torch.empty_like(query)
    if decode is not None:
        queries = query.index_select(0, decode.tokens)
        attended = decode_attention(queries, kv_cache, decode, scale, workspace)
        out.index_copy_(0, decode.tokens, attended)
    for p in prefills:
        rows = slice(p.start, p.start + p.query_len)
        out[rows] = _prefill(query, key, value, kv_cache, p, scale, workspace)
    return out


def probe_steps(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(query_lens, context_lens) of the steps whose attention temporaries are the largest
    that the scheduler limits allow, for peak-memory profiling: a full decode chunk of
    requests at max_model_len, and a prefill at max_model_len whose mask slice is full."""
    padded = cdiv(max_model_len, block_size) * block_size
    num_decodes = min(max_num_seqs, max_num_batched_tokens, max(1, CHUNK_POSITIONS // padded))
    steps = [(np.ones(num_decodes, np.int32), np.full(num_decodes, max_model_len - 1, np.int32))]
    rows = min(
        max_num_batched_tokens,
        max_model_len - 1,
        max(2, PREFILL_MASK_ELEMENTS // max_model_len),
    )
    if rows >= 2:
        steps.append((np.array([rows], np.int32), np.array([max_model_len - rows], np.int32)))
    return steps


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    p: PrefillRequest,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """The request's [query_len, num_heads, head_dim] attention output."""
    # [1, heads, tokens, head_dim]: SDPA's fused CPU kernel takes 4-D inputs only (3-D
    # ones fall back to the math path, which materialises every score).
    tokens = slice(p.start, p.start + p.query_len)
    q = query[tokens].transpose(0, 1)[None]
    gqa = query.shape[1] != key.shape[1]
    if p.block_ids is None:
        k, v = key[tokens].transpose(0, 1)[None], value[tokens].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    keys, values = workspace.gather(kv_cache, p.block_ids, query.shape[2])
    keys, values = keys[None], values[None]
    rows = max(1, PREFILL_MASK_ELEMENTS // (p.context_len + p.query_len))
    out = torch.empty_like(q)
    for first in range(0, p.query_len, rows):
        last = min(first + rows, p.query_len)
        # Query i sits at position context_len + i and sees the keys up to it.
        seen = p.context_len + last
        positions = torch.arange(p.context_len + first, seen, device=q.device)
        mask = torch.arange(seen, device=q.device)[None, :] <= positions[:, None]
        out[:, :, first:last] = F.scaled_dot_product_attention(
            q[:, :, first:last],
            keys[:, :, :seen],
            values[:, :, :seen],
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )
    return out[0].transpose(0, 1)
