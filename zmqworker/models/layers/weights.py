"""Where a parameter's values come from in a checkpoint: named tensors, cut along one dim.

Layers describe their sources with TensorSlice lists; the loader reads exactly those
slices (and nothing else) from the safetensors files. A parameter whose checkpoint can
come in more than one layout (experts one tensor each as published, or stacked as
transformers holds them) names its layouts with OneOf.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSlice:
    """Rows [start, start + length) along `dim` of checkpoint tensor `name` (whose full
    shape must be `shape`) go to [dst_start, dst_start + length) along `dim` of the
    parameter.

    Stacked expert parameters ([experts, rows, cols]): a 2-D checkpoint tensor (one
    expert's) fills the parameter's expert `dst_expert`; a 3-D one (every expert's,
    stacked) gives its experts [src_experts[0], src_experts[0] + src_experts[1]) to the
    parameter's, in order. `dim` counts from the rows in both cases."""

    name: str
    shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    dst_start: int
    dst_expert: int | None = None
    src_experts: tuple[int, int] | None = None


@dataclass(frozen=True)
class OneOf:
    """Layouts a parameter can load from: the first whose tensors the checkpoint all holds."""

    layouts: tuple[tuple[TensorSlice, ...], ...]


def whole(name: str, shape: tuple[int, ...]) -> TensorSlice:
    """The whole tensor, copied as is."""
    return TensorSlice(name, shape, 0, 0, shape[0], 0)
