"""Where a parameter's values come from in a checkpoint: named tensors, cut along one dim.

Layers describe their sources with TensorSlice lists; the loader reads exactly those
slices (and nothing else) from the safetensors files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSlice:
    """Rows [start, start + length) along `dim` of checkpoint tensor `name` (whose full
    shape must be `shape`) go to [dst_start, dst_start + length) along `dim` of the
    parameter."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    dst_start: int


def whole(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """The whole tensor, copied as is."""
    return TensorSlice(name, shape, 0, 0, shape[0], 0)
