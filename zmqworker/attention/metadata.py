"""Per-step attention metadata: built once per step, read by every layer.

Besides the scheduler-level fields, it sorts the step's requests by how they are attended:
decode requests (one query token each) all together, with their plans (decode.py), and
each prefill request (more tokens: a fresh prompt, a chunk of one, or a prompt whose
prefix is cached) on its own, so that no request pads another's queries or history. The
gather workspace the attention copies histories into is the model runner's, handed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.attention.decode import AttentionGeometry, DecodeRequests, plan_decode
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv


@dataclass
class PrefillRequest:
    """A request that schedules more than one token; its tokens are contiguous in the step."""

    start: int  # its first token among the step's
    query_len: int
    context_len: int  # tokens already cached before this step
    block_ids: torch.Tensor | None  # int64 [ceil(seq_len / block_size)]; None without context


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    slot_blocks: torch.Tensor  # int64 [num_tokens]: slot_mapping // block_size
    slot_offsets: torch.Tensor  # int64 [num_tokens]: slot_mapping % block_size
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1] cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_reqs] context length after this step
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    max_query_len: int
    max_seq_len: int
    num_reqs: int
    block_size: int
    decode: DecodeRequests | None
    prefills: list[PrefillRequest]
    workspace: GatherWorkspace


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
    needed = cdiv(int(seq_lens.max()), block_size)
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
    geometry: AttentionGeometry,
    workspace: GatherWorkspace,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata of one step whose tokens are ordered request by request.

    query_lens/seq_lens int32 [num_reqs]; block_tables int32 [num_reqs, max_blocks] (only
    the first ceil(seq_len / block_size) entries of a row are read); slot_mapping int64
    [num_tokens]; geometry: the layers' attention, which the decode plans are made for.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
    _check_inputs(query_lens, seq_lens, block_tables, slot_mapping, block_size)
    num_reqs = len(query_lens)
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    is_decode = query_lens == 1
    decode = None
    if is_decode.any():
        rows = np.flatnonzero(is_decode)
        tokens = None
        if len(rows) < num_reqs:
            tokens = torch.from_numpy(query_start[rows]).to(device)
        plans = plan_decode(block_tables[rows], seq_lens[rows], block_size, geometry, device)
        decode = DecodeRequests(tokens, geometry, plans)
    prefills = []
    for r in np.flatnonzero(~is_decode).tolist():
        context = int(seq_lens[r] - query_lens[r])
        block_ids = None
        if context > 0:
            used = block_tables[r, : cdiv(int(seq_lens[r]), block_size)].astype(np.int64)
            block_ids = torch.from_numpy(used).to(device)
        prefills.append(PrefillRequest(int(query_start[r]), int(query_lens[r]), context, block_ids))

    slot_blocks, slot_offsets = np.divmod(slot_mapping, block_size)
    return AttentionMetadata(
        num_tokens=int(query_start[-1]),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        slot_blocks=torch.from_numpy(slot_blocks).to(device),
        slot_offsets=torch.from_numpy(slot_offsets).to(device),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, np.int32)).to(device),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        num_reqs=num_reqs,
        block_size=block_size,
        decode=decode,
        prefills=prefills,
        workspace=workspace,
    )
