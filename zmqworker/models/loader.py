"""Weight loading from a Hugging Face checkpoint folder (safetensors, sharded or not).

Every parameter layer describes the checkpoint slices it needs (TensorSlice, or OneOf its
layouts); past every file's header, this module opens only the files that hold them and
reads only those slices, so a pipeline stage never reads another stage's layers, a TP rank
reads only its shard and an expert-parallel rank only its experts. Any mix of float32,
bfloat16 and float16 tensors is cast into the parameters' dtype; a quantized checkpoint
(by its config.json, a side file or its tensors) is refused here too: the engine refuses
it before the workers start, but a worker may be driven by an engine that did not, and a
reload from another folder passes no engine check.

A checkpoint must hold exactly the model's weights: a tensor no layout of the whole model
takes (every stage, every shard) is refused, since it may carry maths the config leaves
out (biases with attention_bias false, another family's q/k norms or shared expert), as
is a parameter given in two layouts. Left aside, as transformers leaves them: rotary
inv_freq buffers, a tied model's own lm_head.weight (which must equal the embedding) and
KV-cache scales.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Collection, Container, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.models.checkpoint_files import (
    CheckpointError,
    SafetensorsFiles,
    TensorHeader,
    read_json,
)
from zmqworker.models.layers.weights import OneOf, TensorSlice
from zmqworker.models.quantization import (
    FLOAT_DTYPES,
    dtype_name,
    refuse_quantized_config,
    refuse_quantized_tensors,
)


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
    refuse_quantized_config(folder, read_json(folder / "config.json"))
    files = SafetensorsFiles.read(folder)
    if not files.headers:
        raise FileNotFoundError(f"no safetensors weights in checkpoint folder {path}")
    refuse_quantized_tensors(files)
    return files


Layouts = tuple[tuple[TensorSlice, ...], ...]


def parameter_sources(model: nn.Module) -> Iterator[tuple[torch.Tensor, Layouts]]:
    """Each parameter this rank's layers fill from a checkpoint, with the layouts it can
    come in (one for most; experts published one tensor each or stacked, OneOf)."""
    for module in model.modules():
        slices_of = getattr(module, "tensor_slices", None)
        if slices_of is None:
            continue
        for attr, slices in slices_of().items():
            layouts = slices.layouts if isinstance(slices, OneOf) else (tuple(slices),)
            yield getattr(module, attr), layouts


def whole_model(model: nn.Module) -> nn.Module:
    """The same layers for all stages, unsharded, on the meta device (no memory)."""
    meta = torch.device("meta")
    state = single_rank_state(meta)
    with meta:
        return type(model)(model.hf_config, state, model.dtype, model.flags, 1)


def loading_plan(
    model: nn.Module, held: Container[str] = ()
) -> list[tuple[torch.Tensor, TensorSlice]]:
    """Every (parameter, checkpoint slice) this rank's layers ask for; of a parameter's
    layouts, the first whose tensors are all in held (else the first)."""
    plan = []
    for param, layouts in parameter_sources(model):
        held_layouts = [layout for layout in layouts if all(s.name in held for s in layout)]
        plan.extend((param, s) for s in (held_layouts or layouts)[0])
    return plan


def _check_slice(header: TensorHeader, s: TensorSlice, path: str) -> None:
    """A checkpoint tensor the slice may be read from: a float (casting anything else
    would make a wrong weight) of the shape the model expects."""
    if header.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"tensor {s.name} in checkpoint {path} is {dtype_name(header.dtype)}: the "
            "workers load float32, bfloat16 or float16 weights, not quantized ones"
        )
    if tuple(header.shape) != s.shape:
        raise CheckpointError(
            f"tensor {s.name} in checkpoint {path} has shape {list(header.shape)}, the model "
            f"expects {list(s.shape)}"
        )


def cut(whole: Any, s: TensorSlice) -> torch.Tensor:
    """What slice s takes of its whole checkpoint tensor: a tensor, or a safetensors
    slice (which reads only that part)."""
    end = s.start + s.length
    if s.src_experts is not None:
        first, count = s.src_experts
        experts = slice(first, first + count)
        return whole[experts, s.start : end] if s.dim == 0 else whole[experts, :, s.start : end]
    return whole[s.start : end] if s.dim == 0 else whole[:, s.start : end]


def slice_destination(param: torch.Tensor, s: TensorSlice) -> torch.Tensor:
    """The part of param that slice s fills (an expert of a stacked parameter included)."""
    if s.src_experts is not None:
        return param.data.narrow(s.dim + 1, s.dst_start, s.length)
    target = param.data if s.dst_expert is None else param.data[s.dst_expert]
    return target.narrow(s.dim, s.dst_start, s.length)


class PartialLoadError(RuntimeError):
    """A load or an update failed once weights may have changed (on this rank or another):
    the rank refuses steps until a complete update or a reload, and an engine that sees
    this error refuses requests until then too."""


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str) -> LoadReport:
    """Copy every slice the model's layers ask for from the folder into their parameters,
    in place. Every name, dtype and shape of the WHOLE model (every stage, shard and
    expert, not only this rank's) is checked first, from the files' headers, and a tied
    model's own head against its embedding: every rank of a model reaches the same verdict
    on the same folder, and a checkpoint that does not fit changes nothing anywhere."""
    files = checkpoint_files(path)
    index = files.index()
    whole = whole_model(model)
    _check_plan(loading_plan(whole, index), files, path)
    _refuse_foreign_tensors(whole, index, path)
    _refuse_differing_tied_copies(whole, files, path)
    plan = loading_plan(model, index)
    _check_plan(plan, files, path)  # a subset of the whole model's: passes (kept as a guard)
    by_file: dict[str, list[tuple[torch.Tensor, TensorSlice]]] = defaultdict(list)
    for param, s in plan:
        by_file[index[s.name]].append((param, s))
    report = LoadReport()
    try:
        for file_name, entries in sorted(by_file.items()):
            with safe_open(str(Path(path) / file_name), framework="pt", device="cpu") as f:
                for param, s in entries:
                    slice_destination(param, s).copy_(cut(f.get_slice(s.name), s))
                    report.tensors.add(s.name)
            report.files.add(file_name)
    except Exception as exc:  # a file unreadable past its header (a disk error, a race)
        raise PartialLoadError(
            f"loading checkpoint {path} failed after {len(report.tensors)} tensor(s) were "
            f"copied: {type(exc).__name__}: {exc}"
        ) from exc
    return report


def _check_plan(
    plan: list[tuple[torch.Tensor, TensorSlice]], files: SafetensorsFiles, path: str
) -> None:
    """Every tensor the plan reads is in the folder, a float of the expected shape."""
    index, headers = files.index(), files.tensors()
    missing = sorted({s.name for _, s in plan if s.name not in index})
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor(s): {', '.join(missing[:8])}{more}")
    for _, s in plan:
        _check_slice(headers[s.name], s, path)


# Rows of a tied head and its embedding compared at a time (bounded memory).
_COMPARE_BYTES = 64 << 20


def _refuse_differing_tied_copies(whole: nn.Module, files: SafetensorsFiles, path: str) -> None:
    """A tied parameter takes another tensor (the LM head the embedding's); where the
    checkpoint holds its own tensor too, the two must be equal: transformers uses them
    untied when they differ, and tying them would be another model. Checked on the whole
    model (whole_model), so that a stage without the head refuses such a folder too."""
    index, headers = files.index(), files.tensors()
    dtype = whole.dtype  # the parameters of a model on the meta device may not have it yet
    for module in whole.modules():
        copies_of = getattr(module, "tied_copies", None)
        for _, own, source in copies_of() if copies_of is not None else []:
            if own.name not in index:
                continue
            _check_slice(headers[own.name], own, path)
            row_bytes = max(1, math.prod(own.shape[1:]) * 4)
            step = max(1, _COMPARE_BYTES // row_bytes)
            for start in range(own.start, own.start + own.length, step):
                rows = min(step, own.start + own.length - start)
                mine, taken = (  # as the model holds them
                    _read_slice(path, index[s.name], replace(s, start=start, length=rows)).to(dtype)
                    for s in (own, source)
                )
                if not torch.equal(mine, taken):
                    raise CheckpointError(
                        f"checkpoint {path} ties {own.name} to {source.name} "
                        f"(tie_word_embeddings), but holds a {own.name} that differs from it: "
                        "transformers uses the two untied; set tie_word_embeddings to false"
                    )


def _read_slice(path: str, file_name: str, s: TensorSlice) -> torch.Tensor:
    with safe_open(str(Path(path) / file_name), framework="pt", device="cpu") as f:
        return cut(f.get_slice(s.name), s)


# Tensors a checkpoint may hold beside the weights, which transformers ignores as well:
# rotary inv_freq buffers (older conversions), KV-cache scales (k_scale, v_scale, ...).
_IGNORED = re.compile(
    r"(^|\.)rotary_emb\.inv_freq$|\.(k|v|kv|q|prob)_scale$|\.[kv]_proj\.output_scale$"
)
# A tensor the model has no place for, and the config field that leaves it out.
_FIELDS = (
    (re.compile(r"\.self_attn\.[qkvo]_proj\.bias$"), "attention_bias"),
    (re.compile(r"\.mlp\.(gate|up|down)_proj\.bias$"), "mlp_bias"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _refuse_foreign_tensors(whole: nn.Module, held: Collection[str], path: str) -> None:
    """Refuse checkpoint tensors that no layout of the whole model (whole_model) takes
    (not this rank's plan: other stages and shards load other names), and a parameter
    given in two layouts (transformers refuses that too)."""
    names: set[str] = set()
    for _, layouts in parameter_sources(whole):
        given = [sorted(s.name for s in layout if s.name in held) for layout in layouts]
        used = [found[0] for found in given if found]
        if len(used) > 1:
            raise CheckpointError(
                f"checkpoint {path} holds {used[0]} and {used[1]}: two layouts of the same "
                "weights (experts one tensor each, or stacked); a checkpoint holds one"
            )
        names.update(s.name for layout in layouts for s in layout)
    for module in whole.modules():
        copies_of = getattr(module, "tied_copies", None)
        names.update(own.name for _, own, _ in (copies_of() if copies_of is not None else []))
    foreign = sorted(n for n in held if n not in names and not _IGNORED.search(n))
    if foreign:
        cfg = whole.hf_config
        more = f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else ""
        raise CheckpointError(
            f"checkpoint {path} holds tensor(s) that no weight of this "
            f"{getattr(cfg, 'model_type', None)!r} model takes: "
            f"{'; '.join(_foreign(name, cfg) for name in foreign[:5])}{more}. transformers "
            "would drop them and the maths they carry: the config does not describe this "
            "checkpoint"
        )


def _foreign(name: str, cfg: Any) -> str:
    """The name, and the config field that leaves it out where one does."""
    for pattern, field_name in _FIELDS:
        if pattern.search(name) and getattr(cfg, field_name, None) is False:
            return f"{name} present but {field_name} is false"
    layer = _LAYER.match(name)
    if layer and int(layer[1]) >= cfg.num_hidden_layers:
        return f"{name} present but num_hidden_layers is {cfg.num_hidden_layers}"
    return name
