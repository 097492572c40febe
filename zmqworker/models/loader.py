"""Weight loading from a Hugging Face checkpoint folder (safetensors, sharded or not).

Every parameter layer describes the checkpoint slices it needs (TensorSlice, or OneOf its
layouts); this module opens only the files that hold them and reads only those slices, so
a pipeline stage never touches another stage's layers, a TP rank reads only its shard and
an expert-parallel rank only its experts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zmqworker.models.layers.weights import OneOf, TensorSlice

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint folder does not hold what the model needs."""


@dataclass
class LoadReport:
    """What a load touched: checkpoint tensor names read and file names opened."""

    tensors: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


def checkpoint_index(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file name within the folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    index_file = folder / INDEX_FILE
    if index_file.exists():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_file} has no weight_map")
        return dict(weight_map)
    files = (
        [folder / SINGLE_FILE]
        if (folder / SINGLE_FILE).exists()
        else sorted(folder.glob("*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no safetensors weights in checkpoint folder {path}")
    index: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            index.update((name, file.name) for name in f.keys())
    return index


def _loading_plan(
    model: nn.Module, index: dict[str, str]
) -> list[tuple[torch.Tensor, TensorSlice]]:
    plan = []
    for module in model.modules():
        slices_of = getattr(module, "tensor_slices", None)
        if slices_of is None:
            continue
        for attr, slices in slices_of().items():
            param = getattr(module, attr)
            if isinstance(slices, OneOf):
                slices = _layout_held(slices, index)
            plan.extend((param, s) for s in slices)
    return plan


def _layout_held(choice: OneOf, index: dict[str, str]) -> tuple[TensorSlice, ...]:
    """The first layout whose tensors are all in the checkpoint (else the first: the
    missing ones are named then)."""
    for layout in choice.layouts:
        if all(s.name in index for s in layout):
            return layout
    return choice.layouts[0]


def _read_slice(f, s: TensorSlice, path: str) -> torch.Tensor:
    part = f.get_slice(s.name)
    shape = tuple(part.get_shape())
    if shape != s.shape:
        raise CheckpointError(
            f"tensor {s.name} in checkpoint {path} has shape {list(shape)}, the model "
            f"expects {list(s.shape)}"
        )
    end = s.start + s.length
    if s.src_experts is not None:
        first, count = s.src_experts
        experts = slice(first, first + count)
        return part[experts, s.start : end] if s.dim == 0 else part[experts, :, s.start : end]
    return part[s.start : end] if s.dim == 0 else part[:, s.start : end]


def _destination(param: torch.Tensor, s: TensorSlice) -> torch.Tensor:
    if s.src_experts is not None:
        return param.data.narrow(s.dim + 1, s.dst_start, s.length)
    target = param.data if s.dst_expert is None else param.data[s.dst_expert]
    return target.narrow(s.dim, s.dst_start, s.length)


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str) -> LoadReport:
    """Copy every slice the model's layers ask for from the folder into their parameters."""
    index = checkpoint_index(path)
    plan = _loading_plan(model, index)
    missing = sorted({s.name for _, s in plan if s.name not in index})
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s): {', '.join(missing[:8])}{more}")
    by_file: dict[str, list[tuple[torch.Tensor, TensorSlice]]] = defaultdict(list)
    for param, s in plan:
        by_file[index[s.name]].append((param, s))
    report = LoadReport()
    for file_name, entries in sorted(by_file.items()):
        with safe_open(str(Path(path) / file_name), framework="pt", device="cpu") as f:
            for param, s in entries:
                values = _read_slice(f, s, path)
                _destination(param, s).copy_(values)
                report.tensors.add(s.name)
        report.files.add(file_name)
    return report
