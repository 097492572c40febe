"""Structured-output constraints: a packed token bitmask applied to logits before sampling."""

from __future__ import annotations

import numpy as np
import torch

from zmqworker.cdiv import cdiv
from zmqworker.model_runner.host_to_device import to_device

_BITS = 32


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray, names: list[str]
) -> None:
    """Set logits[rows[i], j] to -inf where bit j of bitmask[i] is 0 (word j // 32, bit
    j % 32). A bitmask narrower than the vocabulary disallows the tokens it does not cover.
    names[i] names the request of rows[i] in errors."""
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
    allowed_bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    empty = np.flatnonzero(~allowed_bits.any(axis=1))
    if len(empty):
        raise ValueError(f"grammar bitmask allows no token for {names[int(empty[0])]}")
    device = logits.device
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
    bits = (to_device(packed, torch.int32, device).unsqueeze(-1) >> shifts) & 1
    allowed = torch.zeros(len(rows), words * _BITS, dtype=torch.bool, device=device)
    allowed[:, : bits.shape[1] * _BITS] = bits.flatten(1).bool()
    allowed = allowed[:, :vocab]
    index = to_device(np.asarray(rows), torch.int64, device)
    logits[index] = logits[index].masked_fill_(~allowed, -torch.inf)
