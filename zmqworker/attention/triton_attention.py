"""Paged attention in Triton, for CUDA steps: no SDPA, no gather of the history, no
per-request Python loop.

Both kernels read the cache in its own layout (kv_cache.py): a (block, kv head) page holds
head_dim x block_size keys (transposed) and block_size x head_dim values, so a tile of
history positions (tile_size) lies in one page and loads as contiguous runs, or, when
pages are small, is addressed position by position through the block table. The query
heads that share a kv head are attended together, as rows of one tile, so each program
reads its kv head's history once.

- paged_attention: a step's attention from its q/k/v projection, rotary and the cache
  write included (and the heads' q and k norms, where the family has them): decode_attention
  for decode steps, else the rotary-and-cache kernel (triton_cache.py) then
  varlen_attention.
- varlen_attention: any step (prefills, chunks over a cached prefix, decodes, mixed). One
  program per (tile of BLOCK_Q query tokens of one request, kv head); a program finds its
  request by binary search over query_start_loc, so the grid needs only host-known sizes.
  The step's own keys are already in the cache (written first), so one causal loop over
  the cache covers the cached prefix and the new tokens alike.
- decode_attention: steps whose requests all schedule one token (the CUDA-graph path).
  One program per (request, kv head, split of the history); each rotates its query heads
  as it loads them, and the split that holds the last position also rotates the token's
  key and writes it and the value into the cache first: no rotary kernel of its own.
  With more than one split, a second kernel merges the splits' partial results by their
  softmax statistics (triton_decode.py).
"""

from __future__ import annotations

import torch
import triton

from zmqworker.attention.head_norms import HeadNorms, norm_args
from zmqworker.attention.triton_cache import rope_and_cache
from zmqworker.attention.triton_decode import decode_kernel, merge_kernel
from zmqworker.attention.triton_kernels import varlen_kernel
from zmqworker.attention.triton_metadata import (
    FEW_SPLITS,
    MIN_LONG_SPLIT,
    TritonAttentionMetadata,
    asks_ahead,
    merge_chunk,
    tile_size,
)
from zmqworker.cdiv import cdiv
from zmqworker.dot_precision import dot_precision
from zmqworker.pdl import launch_options

LOG2E = 1.4426950408889634
# Query rows of one tile; the first power of two above the group when it is larger.
MIN_ROWS = 16
PREFILL_ROWS = 64
# Small programs, many of them: a decode program streams its history with little math,
# and more of them in flight hide the memory latency (triton_metadata.py has the sweep).
# One software-pipeline stage: two were as fast or slower at every shape (docs/cuda.md).
DECODE_LAUNCH = {"num_warps": 2, "num_stages": 1}
# The merge's programs: a warp for every MERGE_WARP_VALUES of their tile, at most 4 (the
# widest tile at batch 1), one for the few partials of a large batch (docs/cuda.md).
MERGE_WARP_VALUES = 1024


def _rows(group: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(group))


def paged_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """A step's attention from its fused projection qkv [num_tokens, num_heads + 2 *
    num_kv_heads, head_dim] (unit strides but the first), queries and keys not yet
    rotated (nor normalised, with norms): rotary at meta.positions (cos_sin [positions,
    head_dim]: cos then sin), this step's keys and values into the cache at
    meta.slot_mapping, attention over the cache. A decode step does all of it in one
    kernel (and a merge kernel where its history splits); any other step rotates and
    writes first (triton_cache.py), then runs the varlen kernel. Returns a new contiguous
    [num_tokens, num_heads, head_dim]."""
    if meta.decode_only:
        return decode_attention(qkv, num_heads, cos_sin, kv_cache, meta, scale, norms)
    num_kv_heads = kv_cache.shape[2]
    rope_and_cache(
        qkv, num_heads, num_kv_heads, cos_sin, meta.positions, meta.slot_mapping, kv_cache,
        norms,
    )  # fmt: skip
    return varlen_attention(qkv[:, :num_heads], kv_cache, meta, scale)


def _common(num_heads: int, kv_cache: torch.Tensor, head_dim: int, dtype: torch.dtype) -> dict:
    """The constexprs both kernels take, from the cache's geometry."""
    num_kv_heads = kv_cache.shape[2]
    block_size = kv_cache.shape[3] // head_dim
    return dict(
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=tile_size(block_size),
        PRECISION=dot_precision(dtype),
        **launch_options(kv_cache.device),
    )


def decode_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """paged_attention of a decode step (one token per request, the token of request r
    at row r), in one kernel (and the merge's, where the history splits)."""
    num_tokens, _, head_dim = qkv.shape
    if qkv.stride(2) != 1 or qkv.stride(1) != head_dim:
        raise ValueError(f"qkv must have unit head strides, got strides {qkv.stride()}")
    if not meta.decode_only or num_tokens != meta.num_reqs:
        raise ValueError(
            f"decode_attention needs one token per request, got {num_tokens} tokens for "
            f"{meta.num_reqs} requests"
        )
    common = _common(num_heads, kv_cache, head_dim, qkv.dtype)
    num_kv_heads = common["NUM_KV_HEADS"]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    splits = meta.num_splits
    if splits > 1:
        width = meta.num_reqs * num_heads * splits
        part_out = torch.empty(width * common["HEAD_DIM_P"], dtype=torch.float32, device=qkv.device)
        part_stats = torch.empty(width * 2, dtype=torch.float32, device=qkv.device)
    else:
        part_out = part_stats = out  # unused
    tables = meta.block_tables
    splitting = {"NUM_SPLITS": splits, "FEW": FEW_SPLITS, "MIN_LONG": MIN_LONG_SPLIT}
    decode_kernel[(meta.num_reqs, num_kv_heads, splits)](
        out,
        part_out,
        part_stats,
        qkv,
        cos_sin,
        meta.positions,
        meta.slot_mapping,
        kv_cache,
        *norm_args(norms, head_dim, qkv.dtype, cos_sin),
        kv_cache[0].numel(),
        tables,
        meta.seq_lens,
        scale * LOG2E,
        qkv.stride(0),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        NUM_HEADS=num_heads,
        BLOCK_M=_rows(common["GROUP"], MIN_ROWS),
        QK_NORM=norms is not None,
        PREFETCH=common["PDL"] and asks_ahead(meta.num_reqs, common["BLOCK_SIZE"], tables),
        **splitting,
        **common,
        **DECODE_LAUNCH,
    )
    if splits > 1:
        chunk = merge_chunk(splits, common["HEAD_DIM_P"])
        warps = max(1, min(4, splits * chunk // MERGE_WARP_VALUES))
        merge_kernel[(meta.num_reqs, num_heads, cdiv(head_dim, chunk))](
            out,
            part_out,
            part_stats,
            meta.seq_lens,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P=common["HEAD_DIM_P"],
            CHUNK_D=chunk,
            TILE_N=common["TILE_N"],
            PDL=common["PDL"],
            launch_pdl=common["launch_pdl"],
            **splitting,
            num_warps=warps,
            num_stages=1,
        )
    return out


def varlen_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] (rotated; any strides with a unit last
    one) against the cache, which already holds this step's keys and values. Returns a
    new contiguous [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    common = _common(num_heads, kv_cache, head_dim, query.dtype)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    tables = meta.block_tables
    rows = _rows(common["GROUP"], PREFILL_ROWS if meta.max_query_len > 1 else MIN_ROWS)
    block_q = rows // common["GROUP"]
    grid = (num_tokens // block_q + meta.num_reqs, common["NUM_KV_HEADS"])
    varlen_kernel[grid](
        out,
        query,
        kv_cache,
        kv_cache[0].numel(),
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.num_reqs,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        BLOCK_M=rows,
        BLOCK_Q=block_q,
        **common,
    )
    return out
