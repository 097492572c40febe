"""Paged attention in Triton, for CUDA steps: no SDPA, no gather of the history, no
per-request Python loop.

Both kernels read the cache in its own layout (kv_cache.py): a (block, kv head) page holds
head_dim x block_size keys (transposed) and block_size x head_dim values, so a tile of
history positions (tile_size) lies in one page and loads as contiguous runs, or, when
pages are small, is addressed position by position through the block table. The query
heads that share a kv head are attended together, as rows of one tile, so each program
reads its kv head's history once.

- varlen_attention: any step (prefills, chunks over a cached prefix, decodes, mixed). One
  program per (tile of BLOCK_Q query tokens of one request, kv head); a program finds its
  request by binary search over query_start_loc, so the grid needs only host-known sizes.
  The step's own keys are already in the cache (written first), so one causal loop over
  the cache covers the cached prefix and the new tokens alike.
- decode_attention: steps whose requests all schedule one token (the CUDA-graph path).
  One program per (request, kv head, split of the history); with more than one split,
  the split that finishes last merges the partial results by their softmax statistics
  (a counter per (request, kv head) in the metadata tells it), in the same launch.
"""

from __future__ import annotations

import torch
import triton

from zmqworker.attention.triton_kernels import decode_kernel, varlen_kernel
from zmqworker.attention.triton_metadata import TritonAttentionMetadata, tile_size
from zmqworker.dot_precision import dot_precision

LOG2E = 1.4426950408889634
# Query rows of one tile; the first power of two above the group when it is larger.
MIN_ROWS = 16
PREFILL_ROWS = 64
# Small programs, many of them: a decode program streams its history with little math,
# and more of them in flight hide the memory latency (triton_metadata.py has the sweep).
DECODE_LAUNCH = {"num_warps": 2, "num_stages": 2}


def _rows(group: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(group))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] (any strides with a unit last one) against
    the cache, which already holds this step's keys and values. Returns a new contiguous
    [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[2]
    block_size = kv_cache.shape[3] // head_dim
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    v_offset = kv_cache[0].numel()
    head_dim_p = triton.next_power_of_2(head_dim)
    common = dict(
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size,
        TILE_N=tile_size(block_size),
        PRECISION=dot_precision(query.dtype),
    )
    qk_scale = scale * LOG2E
    tables = meta.block_tables
    if meta.decode_only:
        splits = meta.num_splits
        rows = _rows(group, MIN_ROWS)
        if splits > 1:
            part_out = torch.empty(
                meta.num_reqs * num_heads * splits * head_dim_p,
                dtype=torch.float32,
                device=query.device,
            )
            part_stats = torch.empty(
                meta.num_reqs * num_heads * splits * 2, dtype=torch.float32, device=query.device
            )
        else:
            part_out = part_stats = out  # unused
        counters = meta.split_counters
        if splits > 1 and (counters is None or counters.numel() < meta.num_reqs * num_kv_heads):
            raise ValueError(
                f"decode with {splits} splits needs split_counters of at least "
                f"{meta.num_reqs} x {num_kv_heads} int32 zeros"
            )
        decode_kernel[(meta.num_reqs, num_kv_heads, splits)](
            out,
            part_out,
            part_stats,
            out if counters is None else counters,
            query,
            kv_cache,
            v_offset,
            tables,
            meta.seq_lens,
            qk_scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            tables.stride(0),
            BLOCK_M=rows,
            NUM_SPLITS=splits,
            **common,
            **DECODE_LAUNCH,
        )
        return out
    rows = _rows(group, PREFILL_ROWS if meta.max_query_len > 1 else MIN_ROWS)
    block_q = rows // group
    grid = (num_tokens // block_q + meta.num_reqs, num_kv_heads)
    varlen_kernel[grid](
        out,
        query,
        kv_cache,
        v_offset,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.num_reqs,
        qk_scale,
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
