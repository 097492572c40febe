"""Attention of decode requests (one query token each) over their whole cached history.

float32 runs on embedding bags, which read the cache in place. Gathering the history into
a contiguous buffer and running SDPA over it passes over the history three times (read,
write, read again); torch's embedding_bag sums index-picked rows, each scaled by its own
weight, in one pass (FBGEMM on CPU):
- scores: keys are stored transposed per (block, head), so the block_size scores of one
  query row against one block are the block's head_dim key rows weighted by the query's
  head_dim components: one bag per (query row, block);
- output: the history's value rows weighted by the softmax probabilities, one bag per
  query row.
Bags round their sums to the cache dtype, which in bfloat16/float16 would cost the scores
precision that SDPA keeps (it accumulates them in float32); those dtypes gather the
history and run SDPA.

Requests are attended in chunks of consecutive ones whose padded histories add up to at
most CHUNK_POSITIONS positions (a longer request alone), which bounds the temporaries of
one call. Each chunk's plan (bag indices, gather ids, masks) depends only on the step's
block tables and the attention's geometry (the same in every layer): it is built with the
step's metadata (plan_decode) and every layer reads it. The plans of a step take about
num_heads * (head_dim / block_size + 1) int32 per history token (SmolLM2: 180 bytes,
against 46 KiB of KV cache per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from zmqworker.attention.kv_cache import key_rows, value_rows
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv

BAG_DTYPES = (torch.float32,)
CHUNK_POSITIONS = 1 << 16


@dataclass(frozen=True)
class AttentionGeometry:
    """What a layer's attention looks like on this rank (the same in every layer)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class BagPlan:
    # Bags (request, query head, block): rows of key_rows(), valid blocks only.
    key_index: torch.Tensor
    key_offsets: torch.Tensor  # bags past a request's last block are empty
    query_rows: torch.Tensor  # int64: the [n * heads] query row weighting each non-empty bag
    # Bags (request, query head): rows of value_rows() for positions [0, max_len); positions
    # past a request's end repeat its last token, whose probability is 0.
    value_index: torch.Tensor
    value_offsets: torch.Tensor
    max_len: int
    pad_mask: torch.Tensor | None  # bool [n, 1, max_len], True past a request's end


@dataclass
class GatherPlan:
    # int64 [n * max_blocks]; past a request's last block, its first block again (masked)
    block_ids: torch.Tensor
    max_len: int
    visible: torch.Tensor | None  # bool [n, 1, 1, max_len], True before a request's end


def build_bag_plan(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_kv_heads: int,
    num_heads: int,
    head_dim: int,
    device: torch.device,
) -> BagPlan:
    """block_tables int [n, max_blocks] (entries past ceil(seq_len / block_size) unread),
    seq_lens int64 [n]."""
    n, group = len(seq_lens), num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    max_blocks = cdiv(max_len, block_size)
    num_blocks = cdiv(seq_lens, block_size)
    used = np.arange(max_blocks)[None, :] < num_blocks[:, None]
    tables = np.where(used, block_tables[:, :max_blocks], block_tables[:, :1]).astype(np.int64)
    # FBGEMM runs faster on int32 indices; they fit unless the cache is enormous.
    top = (int(tables.max()) + 1) * num_kv_heads * max(head_dim, block_size)
    dtype = torch.int32 if top < 2**31 else torch.int64
    kv_head = torch.arange(num_heads, device=device, dtype=dtype) // group

    blocks = torch.from_numpy(tables).to(device, dtype)
    key_base = (blocks[:, None, :] * num_kv_heads + kv_head[None, :, None]) * head_dim
    key_index = key_base[..., None] + torch.arange(head_dim, device=device, dtype=dtype)
    if not used.all():
        key_index = key_index[torch.from_numpy(used).to(device)[:, None, :].expand_as(key_base)]
    bag_sizes = np.broadcast_to(used[:, None, :] * head_dim, (n, num_heads, max_blocks))
    key_offsets = np.concatenate([[0], np.cumsum(bag_sizes.reshape(-1))[:-1]])
    blocks_per_row = torch.from_numpy(np.repeat(num_blocks, num_heads)).to(device)
    query_rows = torch.arange(n * num_heads, device=device).repeat_interleave(
        blocks_per_row, output_size=int(num_blocks.sum()) * num_heads
    )

    positions = np.minimum(np.arange(max_len)[None, :], seq_lens[:, None] - 1)
    slot_blocks = np.take_along_axis(tables, positions // block_size, axis=1)
    value_base = slot_blocks * (num_kv_heads * block_size) + positions % block_size
    value_index = (
        torch.from_numpy(value_base).to(device, dtype)[:, None, :]
        + (kv_head * block_size)[None, :, None]
    )
    pad_mask = None
    if not bool((seq_lens == max_len).all()):
        pad = np.arange(max_len)[None, None, :] >= seq_lens[:, None, None]
        pad_mask = torch.from_numpy(pad).to(device)
    return BagPlan(
        key_index=key_index.reshape(-1),
        key_offsets=torch.from_numpy(key_offsets).to(device, dtype),
        query_rows=query_rows,
        value_index=value_index.reshape(-1),
        value_offsets=torch.arange(0, n * num_heads * max_len, max_len, device=device, dtype=dtype),
        max_len=max_len,
        pad_mask=pad_mask,
    )


def build_gather_plan(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, device: torch.device
) -> GatherPlan:
    max_len = int(seq_lens.max())
    max_blocks = cdiv(max_len, block_size)
    used = np.arange(max_blocks)[None, :] < cdiv(seq_lens, block_size)[:, None]
    # Padding reads the request's own first block: masked, and never another's stale data.
    ids = np.where(used, block_tables[:, :max_blocks], block_tables[:, :1]).astype(np.int64)
    visible = None
    if not bool((seq_lens == max_len).all()):
        before_end = np.arange(max_len)[None, :] < seq_lens[:, None]
        visible = torch.from_numpy(before_end[:, None, None, :]).to(device)
    return GatherPlan(torch.from_numpy(ids.reshape(-1)).to(device), max_len, visible)


def bag_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: BagPlan, scale: float
) -> torch.Tensor:
    """query [n, num_heads, head_dim] -> [n, num_heads, head_dim]."""
    n, num_heads, head_dim = query.shape
    block_size = kv_cache.shape[3] // head_dim
    weights = (query * scale).reshape(n * num_heads, head_dim).index_select(0, plan.query_rows)
    scores = F.embedding_bag(
        plan.key_index,
        key_rows(kv_cache, block_size),
        plan.key_offsets,
        mode="sum",
        per_sample_weights=weights.view(-1),
    )
    scores = scores.view(n, num_heads, -1)[..., : plan.max_len]
    if plan.pad_mask is not None:
        scores = scores.masked_fill(plan.pad_mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    out = F.embedding_bag(
        plan.value_index,
        value_rows(kv_cache, block_size),
        plan.value_offsets,
        mode="sum",
        per_sample_weights=probs.view(-1),
    )
    return out.view(n, num_heads, head_dim)


def gather_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: GatherPlan,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """query [n, num_heads, head_dim] -> [n, num_heads, head_dim], through SDPA."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[2]
    keys, values = workspace.gather(kv_cache, plan.block_ids, head_dim)
    # [kv_heads, n * padded_len, d] -> [n, kv_heads, max_len, d]
    keys = keys.view(num_kv_heads, n, -1, head_dim)[:, :, : plan.max_len].transpose(0, 1)
    values = values.view(num_kv_heads, n, -1, head_dim)[:, :, : plan.max_len].transpose(0, 1)
    # The query heads sharing a kv head become its query rows: no repeated keys.
    packed = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=plan.visible, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def chunk_requests(seq_lens: np.ndarray, block_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive requests whose histories, padded to whole blocks
    and to the chunk's longest, hold at most CHUNK_POSITIONS positions (or one request)."""
    padded = (cdiv(seq_lens, block_size) * block_size).tolist()
    chunks, start, widest = [], 0, 0
    for i, length in enumerate(padded):
        widest = max(widest, length)
        if i > start and (i + 1 - start) * widest > CHUNK_POSITIONS:
            chunks.append((start, i))
            start, widest = i, length
    chunks.append((start, len(padded)))
    return chunks


@dataclass
class DecodeRequests:
    """The step's requests that schedule one token, and how they are attended."""

    # int64 positions of their tokens among the step's; None when they are all of them.
    tokens: torch.Tensor | None
    geometry: AttentionGeometry
    # (rows of the decode requests, the plan of that chunk), in order
    plans: list[tuple[slice, BagPlan | GatherPlan]]


def plan_decode(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    geometry: AttentionGeometry,
    device: torch.device,
) -> list[tuple[slice, BagPlan | GatherPlan]]:
    """The chunks' plans of the decode requests (block_tables [n, max_blocks], seq_lens
    int64 [n], context after the step)."""
    plans: list[tuple[slice, BagPlan | GatherPlan]] = []
    g = geometry
    for start, end in chunk_requests(seq_lens, block_size):
        tables, lens = block_tables[start:end], seq_lens[start:end]
        if g.dtype in BAG_DTYPES:
            plan: BagPlan | GatherPlan = build_bag_plan(
                tables, lens, block_size, g.num_kv_heads, g.num_heads, g.head_dim, device
            )
        else:
            plan = build_gather_plan(tables, lens, block_size, device)
        plans.append((slice(start, end), plan))
    return plans


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: DecodeRequests,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """query [n, num_heads, head_dim] of the decode requests, in their order ->
    [n, num_heads, head_dim]."""
    g = decode.geometry
    if query.shape[1:] != (g.num_heads, g.head_dim) or query.dtype != g.dtype:
        raise ValueError(
            f"decode query {tuple(query.shape)} {query.dtype} differs from the step's planned "
            f"geometry {g}"
        )

    def attend(q: torch.Tensor, plan: BagPlan | GatherPlan) -> torch.Tensor:
        if isinstance(plan, BagPlan):
            return bag_attention(q, kv_cache, plan, scale)
        return gather_attention(q, kv_cache, plan, scale, workspace)

    if len(decode.plans) == 1:
        return attend(query, decode.plans[0][1])
    return torch.cat([attend(query[rows], plan) for rows, plan in decode.plans])
