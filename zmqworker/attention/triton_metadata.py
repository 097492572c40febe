"""The step metadata the Triton attention reads: device tensors plus host-known sizes.

Nothing here depends on the step's data beyond the host ints, so one metadata object over
persistent buffers serves a CUDA graph's every replay. Importing it needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zmqworker.cdiv import cdiv

# Programs that keep every multiprocessor of a large GPU busy in a decode step: below it,
# the history of each (request, kv head) is split over several programs. A decode
# program's history loop is latency-bound (a tile of keys and values in flight at a
# time), so one long history needs as many programs as a large batch; 1024 two-warp
# programs (triton_attention.DECODE_LAUNCH) was the best setting of a sweep (docs/cuda.md).
TARGET_DECODE_PROGRAMS = 1024
# Decode steps of up to this many requests ask their history pages into L2 before the PDL
# wait (asks_ahead): measured faster for one request, slower at 64 (docs/cuda.md).
PREFETCH_REQS = 1
# Past FEW_SPLITS splits a split holds at least MIN_LONG_SPLIT positions: a short
# history's read is short next to a split's fixed costs (its query, its partial), so it
# splits as it would over FEW_SPLITS splits whatever the step's split count.
FEW_SPLITS = 32
MIN_LONG_SPLIT = 64
# The merge kernel loads a head's partials of every split at once, over slices of the
# head dim of at most MERGE_TILE values (merge_chunk; the sweep is in docs/cuda.md).
MERGE_TILE = 4096
# Enough for TARGET_DECODE_PROGRAMS at batch 1 over 4 kv heads; at MERGE_TILE a merge
# program still takes 16 dims of a head (64-byte rows of float32 partials).
MAX_DECODE_SPLITS = 256
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


def split_length(seq_len: int, num_splits: int, tile: int) -> int:
    """History positions per split of a decode over seq_len positions (whole tiles); the
    decode kernel computes the same from the sequence length it reads. Splits past
    cdiv(seq_len, split_length) have nothing to do."""
    even = cdiv(seq_len, num_splits)
    if num_splits > FEW_SPLITS:
        even = max(even, min(cdiv(seq_len, FEW_SPLITS), MIN_LONG_SPLIT))
    return max(1, cdiv(even, tile)) * tile


def asks_ahead(num_reqs: int, block_size: int, block_tables: torch.Tensor) -> bool:
    """Whether a decode step's programs ask their first history pages into L2 before the
    PDL wait (triton_decode.py): steps of up to PREFETCH_REQS requests, over pages of a
    power of two (whole lines of a page, in a range Triton can count) and a table whose
    rows are its stride apart (no page past a row is read)."""
    pow2 = block_size > 0 and block_size & (block_size - 1) == 0
    rows = block_tables.dim() == 2 and block_tables.is_contiguous()
    return num_reqs <= PREFETCH_REQS and pow2 and rows


def decode_splits(num_reqs: int, num_kv_heads: int, max_model_len: int, tile: int) -> int:
    """Splits per (request, kv head) of a decode step: enough programs to fill the GPU, a
    power of two, at most MAX_DECODE_SPLITS and at most what a history of max_model_len
    positions can use (split_length). A function of host-known sizes alone, so a graph
    captured at a batch size holds for any history; a shorter history leaves the last
    splits idle."""
    want = cdiv(TARGET_DECODE_PROGRAMS, max(1, num_reqs * num_kv_heads))
    tiles = cdiv(max_model_len, tile)
    usable = min(tiles, max(FEW_SPLITS, cdiv(max_model_len, MIN_LONG_SPLIT)))
    splits = 1
    while splits * 2 <= min(want, MAX_DECODE_SPLITS, max(1, usable)):
        splits *= 2
    return splits


def merge_chunk(num_splits: int, head_dim_p: int) -> int:
    """Head dims one merge program takes: its partials' tile at most MERGE_TILE values."""
    return max(1, min(head_dim_p, MERGE_TILE // num_splits))


def tile_size(block_size: int) -> int:
    """The attention kernels' tile for a cache of this block size."""
    if block_size >= MIN_TILE and block_size & (block_size - 1) == 0:
        return min(block_size, MAX_TILE)
    return GATHERED_TILE
