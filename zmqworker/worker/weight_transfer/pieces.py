"""Writing a piece of a checkpoint tensor (whole rows along dim 0) into this rank's
parameters, in place: each TensorSlice of the name takes the rows and columns of the
piece that it covers (loader.py's mapping, cut to the piece). Writes go into the
parameters' own storage, so CUDA graphs captured over them stay valid."""

from __future__ import annotations

import torch
from torch import nn

from zmqworker.models.layers.weights import TensorSlice

Target = tuple[nn.Parameter, TensorSlice]


def write_piece(targets: list[Target], row_start: int, piece: torch.Tensor) -> None:
    """piece holds rows [row_start, row_start + len(piece)) of the tensor the targets
    take from (experts, for a stacked expert tensor); copy what each target covers of
    them (asynchronously on CUDA)."""
    rows = piece.shape[0]
    row_end = row_start + rows
    for param, s in targets:
        if s.src_experts is not None:  # rows are experts; each takes its columns
            first, count = s.src_experts
            lo, hi = max(first, row_start), min(first + count, row_end)
            if lo < hi:
                into = param.data.narrow(0, lo - first, hi - lo)
                into = into.narrow(s.dim + 1, s.dst_start, s.length)
                part = piece.narrow(0, lo - row_start, hi - lo).narrow(s.dim + 1, s.start, s.length)
                into.copy_(part, non_blocking=True)
            continue
        dst = param.data if s.dst_expert is None else param.data[s.dst_expert]
        if s.dim == 0:
            lo, hi = max(s.start, row_start), min(s.start + s.length, row_end)
            if lo < hi:
                into = dst.narrow(0, s.dst_start + lo - s.start, hi - lo)
                into.copy_(piece.narrow(0, lo - row_start, hi - lo), non_blocking=True)
        else:  # columns of every row: the parameter has the tensor's rows
            into = dst.narrow(0, row_start, rows).narrow(s.dim, s.dst_start, s.length)
            into.copy_(piece.narrow(s.dim, s.start, s.length), non_blocking=True)


def whole_parameter(targets: list[Target], shape: list[int]) -> nn.Parameter | None:
    """The parameter that is exactly the tensor (one target, the whole tensor, same
    shape, contiguous): a piece can be received straight into its rows."""
    if len(targets) != 1:
        return None
    param, s = targets[0]
    whole = s.dim == 0 and s.start == 0 and s.dst_start == 0 and s.length == shape[0]
    whole = whole and s.dst_expert is None and s.src_experts is None
    if whole and list(param.shape) == list(shape) and param.data.is_contiguous():
        return param
    return None
