"""Per-step attention metadata: built once per step, read by every layer.

Besides the scheduler-level fields, it holds what the paged attention precomputes once
per step so that layers only index and call SDPA: the block ids to gather for each request
(padded rows point at block 0 and are masked), the mask, and the indices that pad the packed
query tokens into a [num_reqs, max_query_len] grid and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1] cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_reqs] context length after this step
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    max_query_len: int
    max_seq_len: int
    num_reqs: int
    block_size: int
    # Block ids to gather, int64 [num_reqs * num_gather_blocks]; unused entries are 0.
    gather_block_ids: torch.Tensor
    num_gather_blocks: int
    # Keys each request attends over after the gather: max_seq_len when every request has
    # the same length (no mask needed), else num_gather_blocks * block_size.
    key_len: int
    # bool [num_reqs, 1, max_query_len, key_len], True where a query may attend; None when
    # no position needs masking.
    attn_mask: torch.Tensor | None
    # One request whose whole context is this step's tokens: plain causal attention over
    # the new keys, no gather.
    is_single_fresh_prefill: bool
    # Every request schedules one token.
    is_decode_only: bool
    # int64 [num_reqs * max_query_len]: packed token index for each grid cell (padding cells
    # repeat a valid token); None when every request has max_query_len tokens.
    query_pad_index: torch.Tensor | None
    # int64 [num_tokens]: grid cell of each packed token; None with query_pad_index.
    query_unpad_index: torch.Tensor | None


def _check_inputs(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if query_lens.ndim != 1 or seq_lens.shape != query_lens.shape:
        raise ValueError(
            f"query_lens {query_lens.shape} and seq_lens {seq_lens.shape} must be 1-D of one length"
        )
    num_reqs = query_lens.shape[0]
    if num_reqs == 0:
        raise ValueError("attention metadata needs at least one request")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"block_tables must be [num_reqs={num_reqs}, max_blocks], got {block_tables.shape}"
        )
    if (query_lens < 1).any():
        raise ValueError(f"every request needs >= 1 query token, got query_lens {query_lens}")
    if (seq_lens < query_lens).any():
        raise ValueError(f"seq_lens {seq_lens} shorter than query_lens {query_lens}")
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != int(query_lens.sum()):
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape} entries, query_lens sum to {query_lens.sum()}"
        )
    needed = -(-int(seq_lens.max()) // block_size)
    if block_tables.shape[1] < needed:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns, a sequence of "
            f"{seq_lens.max()} tokens needs {needed} blocks of {block_size}"
        )


def build_attention_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata of one step whose tokens are ordered request by request.

    query_lens/seq_lens int32 [num_reqs]; block_tables int32 [num_reqs, max_blocks] (only
    the first ceil(seq_len / block_size) entries of a row are read); slot_mapping int64
    [num_tokens].
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
    _check_inputs(query_lens, seq_lens, block_tables, slot_mapping, block_size)
    num_reqs = len(query_lens)
    num_tokens = int(query_lens.sum())
    max_query_len = int(query_lens.max())
    max_seq_len = int(seq_lens.max())
    context_lens = seq_lens - query_lens
    num_gather_blocks = -(-max_seq_len // block_size)

    # Entries past a request's last block may be garbage: point them at block 0, masked.
    used = np.arange(num_gather_blocks)[None, :] < (-(-seq_lens // block_size))[:, None]
    gather = np.where(used, block_tables[:, :num_gather_blocks], 0).astype(np.int64)

    uniform_seq = bool((seq_lens == max_seq_len).all())
    key_len = max_seq_len if uniform_seq else num_gather_blocks * block_size
    is_decode_only = max_query_len == 1
    is_single_fresh_prefill = num_reqs == 1 and int(context_lens[0]) == 0
    attn_mask = None
    if not is_single_fresh_prefill and not (is_decode_only and uniform_seq):
        # Query i of request r sits at position context_len[r] + i and sees keys <= it;
        # this also hides the keys past seq_len and the padded gather slots.
        query_pos = context_lens[:, None] + np.arange(max_query_len)[None, :]
        mask = np.arange(key_len)[None, None, :] <= query_pos[:, :, None]
        attn_mask = torch.from_numpy(mask[:, None]).to(device)

    query_pad_index = query_unpad_index = None
    if not bool((query_lens == max_query_len).all()):
        starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]])
        cells = np.arange(max_query_len)[None, :]
        pad = starts[:, None] + np.minimum(cells, query_lens[:, None] - 1)
        valid = cells < query_lens[:, None]
        query_pad_index = torch.from_numpy(pad.reshape(-1)).to(device)
        query_unpad_index = torch.from_numpy(np.flatnonzero(valid.reshape(-1))).to(device)

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, np.int32)).to(device),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_reqs=num_reqs,
        block_size=block_size,
        gather_block_ids=torch.from_numpy(gather.reshape(-1)).to(device),
        num_gather_blocks=num_gather_blocks,
        key_len=key_len,
        attn_mask=attn_mask,
        is_single_fresh_prefill=is_single_fresh_prefill,
        is_decode_only=is_decode_only,
        query_pad_index=query_pad_index,
        query_unpad_index=query_unpad_index,
    )
