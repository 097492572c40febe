"""Tensor-parallel linear layers: column-parallel (output rows split, possibly fused from
several checkpoint tensors) and row-parallel (input columns split, outputs all-reduced).
On the CUDA (Triton) path, skinny=True sends decode-sized steps to skinny_linear.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zmqworker.distributed.parallel_state import ParallelState, tp_all_reduce
from zmqworker.models.layers.weights import TensorSlice

# oneDNN's JIT kernels use AVX-512 wherever the CPU has it; the MKL sgemm behind F.linear
# does not on every vendor's CPU (AMD Zen 4: every shape of the embedded model gains,
# docs/cuda.md).
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for float32 on the CPU."""
    if _ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SkinnyPath(nn.Module):
    """Decode-sized steps of a CUDA (Triton) layer through the split-K skinny kernel where
    it pays for the layer's shape, over a persistent counter buffer of the layer (empty
    where the kernel is off). Other steps and shapes, and unfused layers, take linear()."""

    def __init__(self, out_features: int, in_features: int, enabled: bool):
        super().__init__()
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.max_rows = 0
        slots = 0
        if enabled:
            from zmqworker.models.layers import skinny_linear

            self.max_rows = skinny_linear.row_limit(out_features, in_features)
            if self.max_rows:
                self.kernel = skinny_linear.skinny_linear
                slots = skinny_linear.counter_slots(out_features)
        self.register_buffer("counters", torch.zeros(slots, dtype=torch.int32), persistent=False)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        skinny = x.dim() == 2 and x.shape[0] <= self.max_rows and x.stride(1) == 1
        if self.kernel is not None and skinny:
            return self.kernel(x, weight, bias, self.counters)
        return linear(x, weight, bias)


@dataclass(frozen=True)
class ColumnPart:
    """Rows [start, start + length) of checkpoint tensor `prefix`.weight (full_rows rows)."""

    prefix: str
    full_rows: int
    start: int
    length: int


def split_evenly(prefix: str, full_rows: int, state: ParallelState) -> ColumnPart:
    """This TP rank's equal share of a tensor's rows."""
    if full_rows % state.tp_size:
        raise ValueError(
            f"{prefix}: {full_rows} output rows are not divisible by tensor parallel size "
            f"{state.tp_size}"
        )
    length = full_rows // state.tp_size
    return ColumnPart(prefix, full_rows, state.tp_rank * length, length)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b where this rank's W stacks the given row ranges of the checkpoint
    tensors (one part: a plain column-parallel linear; several: a fused one, e.g. q/k/v or
    gate/up). The output stays sharded."""

    def __init__(self, input_size: int, parts: list[ColumnPart], bias: bool, skinny: bool = False):
        super().__init__()
        self.input_size = input_size
        self.parts = parts
        self.output_sizes = [p.length for p in parts]
        rows = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(rows, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        self.project = SkinnyPath(rows, input_size, skinny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.weight, self.bias)

    def tensor_slices(self) -> dict[str, list[TensorSlice]]:
        out: dict[str, list[TensorSlice]] = {"weight": []}
        if self.bias is not None:
            out["bias"] = []
        dst = 0
        for p in self.parts:
            out["weight"].append(
                TensorSlice(
                    f"{p.prefix}.weight",
                    (p.full_rows, self.input_size),
                    0,
                    p.start,
                    p.length,
                    dst,
                )
            )
            if self.bias is not None:
                out["bias"].append(
                    TensorSlice(f"{p.prefix}.bias", (p.full_rows,), 0, p.start, p.length, dst)
                )
            dst += p.length
        return out


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b: the input features are split over TP ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        prefix: str,
        bias: bool,
        state: ParallelState,
        skinny: bool = False,
    ):
        super().__init__()
        if input_size % state.tp_size:
            raise ValueError(
                f"{prefix}: {input_size} input features are not divisible by tensor parallel "
                f"size {state.tp_size}"
            )
        self.prefix = prefix
        self.state = state
        self.input_size = input_size
        self.output_size = output_size
        self.local_input = input_size // state.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.project = SkinnyPath(output_size, self.local_input, skinny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.tp_group is None:
            return self.project(x, self.weight, self.bias)
        y = tp_all_reduce(self.project(x, self.weight, None), self.state)
        return y if self.bias is None else y + self.bias

    def tensor_slices(self) -> dict[str, list[TensorSlice]]:
        start = self.state.tp_rank * self.local_input
        full = (self.output_size, self.input_size)
        weight = TensorSlice(f"{self.prefix}.weight", full, 1, start, self.local_input, 0)
        out = {"weight": [weight]}
        if self.bias is not None:
            out["bias"] = [
                TensorSlice(f"{self.prefix}.bias", (self.output_size,), 0, 0, self.output_size, 0)
            ]
        return out
