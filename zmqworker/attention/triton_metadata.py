"""The step metadata the Triton attention reads: device tensors plus host-known sizes.

Nothing here depends on the step's data beyond the host ints, so one metadata object over
persistent buffers serves a CUDA graph's every replay. Importing it needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zmqworker.cdiv import cdiv

# Programs that keep every multiprocessor of a large GPU busy in a decode step: below it,
# the history of each (request, kv head) is split over several programs. 1024 with
# two-warp programs (triton_attention.DECODE_LAUNCH) was the best single setting of a
# sweep on an H200 (bench/results/decode_attention_sweep.json): 13% less time than 512
# with four warps over ten shapes and batches, 22% at 8B's batch 64, never more than
# 1.3% worse.
TARGET_DECODE_PROGRAMS = 1024
MAX_DECODE_SPLITS = 16
# History positions per attention tile: within one page when pages allow (a power of two
# of at least MIN_TILE, the tensor cores' smallest), else gathered across pages.
MIN_TILE = 16
MAX_TILE = 64
GATHERED_TILE = 32


@dataclass(frozen=True)
class TritonAttentionMetadata:
    num_tokens: int
    num_reqs: int
    max_query_len: int
    decode_only: bool  # every request schedules exactly one token
    num_splits: int  # decode_only: programs per (request, kv head), a power of two
    slot_mapping: torch.Tensor  # int32 [num_tokens]: block * block_size + offset; < 0 skips
    positions: torch.Tensor  # int32 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: context after the step; 0 for padding rows
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], rows may be padded
    # int32 zeros, >= num_reqs * num_kv_heads: which split of a decode finishes last. The
    # kernel leaves them zero; a persistent buffer, so that graphs replay over it.
    split_counters: torch.Tensor | None = None


def decode_splits(num_reqs: int, num_kv_heads: int, max_tiles: int) -> int:
    """Splits per (request, kv head) for a decode step: enough programs to fill the GPU,
    a power of two, at most MAX_DECODE_SPLITS and at most the tiles of the longest
    history the step can have."""
    want = cdiv(TARGET_DECODE_PROGRAMS, max(1, num_reqs * num_kv_heads))
    splits = 1
    while splits * 2 <= min(want, MAX_DECODE_SPLITS, max(1, max_tiles)):
        splits *= 2
    return splits


def tile_size(block_size: int) -> int:
    """The attention kernels' tile for a cache of this block size."""
    if block_size >= MIN_TILE and block_size & (block_size - 1) == 0:
        return min(block_size, MAX_TILE)
    return GATHERED_TILE
