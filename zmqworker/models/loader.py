"""Weight loading from a Hugging Face checkpoint folder (safetensors, sharded or not).

Every parameter layer describes the checkpoint slices it needs (TensorSlice); past every
file's header, this module opens only the files that hold them and reads only those
slices, so a pipeline stage never reads another stage's layers and a TP rank reads only
its shard. Any mix of
float32, bfloat16 and float16 tensors is cast into the parameters' dtype; a quantized
checkpoint is refused here too (the engine refuses it before the workers start, but a
worker may be driven by an engine that did not).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from zmqworker.models.checkpoint_files import CheckpointError, SafetensorsFiles
from zmqworker.models.layers.weights import TensorSlice
from zmqworker.models.quantization import FLOAT_DTYPES, dtype_name, refuse_quantized_tensors


@dataclass
class LoadReport:
    """What a load touched: checkpoint tensor names read and file names opened."""

    tensors: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


def checkpoint_files(path: str) -> SafetensorsFiles:
    """The folder's safetensors files, their headers read; a quantized one refused."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    files = SafetensorsFiles.read(folder)
    if not files.headers:
        raise FileNotFoundError(f"no safetensors weights in checkpoint folder {path}")
    refuse_quantized_tensors(files)
    return files


def _loading_plan(model: nn.Module) -> list[tuple[torch.Tensor, TensorSlice]]:
    plan = []
    for module in model.modules():
        slices_of = getattr(module, "tensor_slices", None)
        if slices_of is None:
            continue
        for attr, slices in slices_of().items():
            param = getattr(module, attr)
            plan.extend((param, s) for s in slices)
    return plan


def _read_slice(f, s: TensorSlice, path: str) -> torch.Tensor:
    part = f.get_slice(s.name)
    if part.get_dtype() not in FLOAT_DTYPES:  # casting it would make a wrong weight
        raise CheckpointError(
            f"tensor {s.name} in checkpoint {path} is {dtype_name(part.get_dtype())}: the "
            "workers load float32, bfloat16 or float16 weights, not quantized ones"
        )
    shape = tuple(part.get_shape())
    if shape != s.shape:
        raise CheckpointError(
            f"tensor {s.name} in checkpoint {path} has shape {list(shape)}, the model "
            f"expects {list(s.shape)}"
        )
    end = s.start + s.length
    return part[s.start : end] if s.dim == 0 else part[:, s.start : end]


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str) -> LoadReport:
    """Copy every slice the model's layers ask for from the folder into their parameters."""
    index = checkpoint_files(path).index()
    plan = _loading_plan(model)
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
                param.data.narrow(s.dim, s.dst_start, s.length).copy_(values)
                report.tensors.add(s.name)
        report.files.add(file_name)
    return report
