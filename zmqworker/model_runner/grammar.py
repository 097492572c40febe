"""Structured-output constraints: a packed token bitmask applied to logits before sampling."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from messages import GrammarOutput
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.grammar_upload import BitmaskUpload
from zmqworker.model_runner.host_to_device import to_device
from zmqworker.model_runner.int32_arrays import int32_array

_BITS = 32


def apply_grammar_bitmask(
    logits: torch.Tensor,
    rows: np.ndarray,
    bitmask: np.ndarray,
    names: list[str],
    upload: BitmaskUpload | None = None,
) -> None:
    """Set logits[rows[i], j] to -inf where bit j of bitmask[i] is 0 (word j // 32, bit
    j % 32). A bitmask narrower than the vocabulary disallows the tokens it does not cover.
    names[i] names the request of rows[i] in errors. With upload (the Triton path's), the
    bitmask goes through its buffers to one kernel; else torch ops."""
    vocab = logits.shape[1]
    words = cdiv(vocab, _BITS)
    if bitmask.ndim != 2 or bitmask.shape[0] != len(rows) or bitmask.shape[1] > words:
        raise ValueError(
            f"grammar bitmask must be int32 [{len(rows)}, <= {words}] for a vocabulary of "
            f"{vocab}, got shape {bitmask.shape}"
        )
    if len(rows) == 0:
        return
    if bitmask.dtype != np.int32:  # the model runner converts what the wire brings
        raise ValueError(f"grammar bitmask must be int32 words, got {bitmask.dtype}")
    packed = np.ascontiguousarray(bitmask)
    # Checked on the host, where the bitmask is: a device check would wait for the device.
    empty = _rows_allowing_nothing(packed, vocab)
    if len(empty):
        raise ValueError(f"grammar bitmask allows no token for {names[int(empty[0])]}")
    if upload is not None:
        from zmqworker.model_runner.grammar_kernel import apply_bitmask

        apply_bitmask(logits, *upload.upload(rows, packed))
        return
    # Unpacked a byte at a time (bit j is bit j % 8 of the row's byte j // 8, the words
    # being little-endian int32): the intermediates are n x vocab bytes, not int32s.
    device = logits.device
    row_bytes = to_device(packed.astype("<i4", copy=False).view(np.uint8), torch.uint8, device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    banned = ((row_bytes.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1) == 0
    if banned.shape[1] < vocab:  # a narrower bitmask bans the tokens it does not cover
        rest = torch.ones(len(rows), vocab - banned.shape[1], dtype=torch.bool, device=device)
        banned = torch.cat([banned, rest], dim=1)
    banned = banned[:, :vocab]
    if len(rows) == len(logits) and (rows == np.arange(len(rows))).all():
        logits.masked_fill_(banned, -torch.inf)  # every row, in order: no gather
        return
    index = to_device(np.asarray(rows), torch.int64, device)
    logits[index] = logits[index].masked_fill_(banned, -torch.inf)


def _rows_allowing_nothing(packed: np.ndarray, vocab: int) -> np.ndarray:
    """The rows of packed (int32 words) with no bit set below vocab: compared a word at a
    time, since unpacking every bit of a large batch costs the sampling step milliseconds."""
    full, rest = divmod(vocab, _BITS)
    some = (packed[:, :full] != 0).any(axis=1)
    if rest and packed.shape[1] > full:
        some |= (packed[:, full] & np.int32((1 << rest) - 1)) != 0
    return np.flatnonzero(~some)


def apply_grammar_output(
    logits: torch.Tensor,
    handles: np.ndarray,
    sample_index: np.ndarray,
    grammar: GrammarOutput,
    describe: Callable[[int], str],
    upload: BitmaskUpload | None = None,
) -> None:
    """Apply a step's GrammarOutput to its sampling requests' logits: handles are the
    step's requests, sample_index the positions of those that sample (logits' rows);
    describe names a request by its handle in errors; upload as apply_grammar_bitmask's."""
    sampling = {h: i for i, h in enumerate(handles[sample_index].tolist())}
    in_step = set(handles.tolist())
    grammar_handles = int32_array(grammar.req_handles, "GrammarOutput.req_handles", 1).tolist()
    bitmask = int32_array(grammar.grammar_bitmask, "GrammarOutput.grammar_bitmask", 2)
    keep, targets = [], []
    seen: set[int] = set()
    for k, handle in enumerate(grammar_handles):
        if handle in seen:  # two rows for one request: which one holds is not said
            raise ValueError(f"{describe(handle)}: named twice in GrammarOutput.req_handles")
        seen.add(handle)
        if handle in sampling:
            keep.append(k)
            targets.append(sampling[handle])
        elif handle not in in_step:
            raise ValueError(f"{describe(handle)}: grammar bitmask for a request not in this step")
    if bitmask.shape[0] != len(grammar_handles):
        raise ValueError(
            f"grammar bitmask shape {bitmask.shape} does not match its "
            f"{len(grammar_handles)} request handles"
        )
    names = [describe(grammar_handles[k]) for k in keep]
    rows = bitmask if len(keep) == len(grammar_handles) else bitmask[keep]  # no copy: all
    apply_grammar_bitmask(logits, np.array(targets, np.int64), rows, names, upload)
