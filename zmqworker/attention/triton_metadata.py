"""The step metadata the Triton attention reads: device tensors plus host-known sizes.

Nothing here depends on the step's data beyond the host ints, so one metadata object over
persistent buffers serves a CUDA graph's every replay. Importing it needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Decode splits the history of each (request, kv head) over several programs while the
# step's programs stay within MAX_DECODE_PROGRAMS. With tiles of DECODE_TILE positions, in
# a sweep on an H200 (bench/results/decode_attention_probe.json), batch 1 wants all 16
# splits (SmolLM2 5.9 us a layer against 6.8 at 8), SmolLM2 at 32 wants 8 (9.3 against
# 10.0 at 4), and 8 kv heads at batch 64 want none: partials and their merge cost more
# than the programs win (Llama-3-8B 43.3 us against 49.7, 1B 26.3 against 31.0).
MAX_DECODE_PROGRAMS = 768
MAX_DECODE_SPLITS = 16
# History positions per attention tile: within one page when pages allow (a power of two
# of at least MIN_TILE, the tensor cores' smallest), else gathered across pages.
MIN_TILE = 16
MAX_TILE = 64
GATHERED_TILE = 32
# Decode's tiles: 64 positions, gathered across pages smaller than that. Four times a
# 16-position page, they cut a layer's decode attention by 8-16% at batch 1 and 20-28%
# at batch 64 on an H200 (the sweep above): fewer, larger loads per round trip.
DECODE_TILE = 64


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
    """Splits per (request, kv head) for a decode step: a power of two, as many as keep
    the step within MAX_DECODE_PROGRAMS programs, at most MAX_DECODE_SPLITS and at most
    the tiles of the longest history the step can have."""
    want = MAX_DECODE_PROGRAMS // max(1, num_reqs * num_kv_heads)
    splits = 1
    while splits * 2 <= min(want, MAX_DECODE_SPLITS, max(1, max_tiles)):
        splits *= 2
    return splits


def tile_size(block_size: int) -> int:
    """The attention kernels' tile for a cache of this block size."""
    if block_size >= MIN_TILE and block_size & (block_size - 1) == 0:
        return min(block_size, MAX_TILE)
    return GATHERED_TILE
