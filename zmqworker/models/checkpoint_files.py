"""A checkpoint folder's safetensors files and what their headers say, read without torch:
the engine checks a checkpoint with them before any worker starts, and the workers' loader
finds its tensors with them.

A safetensors file starts with an 8-byte little-endian length and that many bytes of JSON:
every tensor's dtype, shape and byte range (and an optional "__metadata__"). Reading it
touches no tensor data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors refuses larger headers; a larger length means the file is something else.
_MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """The checkpoint folder does not hold what the model needs."""


class TensorHeader(msgspec.Struct, frozen=True):
    dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", "I32", ...
    shape: list[int]
    data_offsets: list[int]


@dataclass(frozen=True)
class SafetensorsFiles:
    """The weight files of a folder (those an index names, else model.safetensors, else
    every *.safetensors) and every tensor's header. A folder with both an index and
    model.safetensors, or a tensor in two files, is refused: which weights it holds would
    depend on who reads it."""

    folder: Path
    headers: dict[str, dict[str, TensorHeader]]  # file name -> its tensors

    @classmethod
    def read(cls, folder: Path) -> SafetensorsFiles:
        """The folder's files and headers; none when it holds no safetensors weights."""
        names = _weight_file_names(folder)
        files = cls(folder, {name: read_header(folder / name) for name in names})
        files._refuse_duplicates()
        return files

    def _refuse_duplicates(self) -> None:
        """A tensor in two files: which one a loader takes depends on its order (a stray
        .safetensors beside the checkpoint's own would override a real weight)."""
        owner: dict[str, str] = {}
        for file, tensors in self.headers.items():
            for tensor in tensors:
                first = owner.setdefault(tensor, file)
                if first != file:
                    raise CheckpointError(
                        f"checkpoint {self.folder} holds tensor {tensor} twice, in {first} "
                        f"and in {file}: remove the file that is not the checkpoint's"
                    )

    def index(self) -> dict[str, str]:
        """Tensor name -> the file that holds it."""
        return {tensor: file for file, tensors in self.headers.items() for tensor in tensors}

    def tensors(self) -> dict[str, TensorHeader]:
        return {name: t for tensors in self.headers.values() for name, t in tensors.items()}


def read_header(file: Path) -> dict[str, TensorHeader]:
    """Tensor name -> its header, from the JSON at the start of a safetensors file."""
    try:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= _MAX_HEADER_BYTES:
                raise CheckpointError(f"{file} is not a safetensors file")
            raw = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {file} does not exist") from None
    if len(raw) < length:
        raise CheckpointError(f"{file} is not a safetensors file (cut short)")
    try:
        entries = msgspec.json.decode(raw, type=dict[str, Any])
        entries.pop("__metadata__", None)
        headers = msgspec.convert(entries, dict[str, TensorHeader])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{file} is not a safetensors file: {exc}") from None
    # Known before any weight is copied: a loader would find it only at this file's turn.
    data = max((t.data_offsets[-1] for t in headers.values() if t.data_offsets), default=0)
    if 8 + length + data > size:
        raise CheckpointError(
            f"{file} is cut short: its header names {data} bytes of tensor data, the file "
            f"holds {size - 8 - length}"
        )
    return headers


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, generation_config.json) as plain JSON; {}
    when there is none."""
    if not path.is_file():
        return {}
    try:
        return msgspec.json.decode(path.read_bytes(), type=dict[str, Any])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _weight_file_names(folder: Path) -> list[str]:
    index_file = folder / INDEX_FILE
    if index_file.exists() and (folder / SINGLE_FILE).exists():
        # transformers loads the single file, vLLM the files the index names.
        raise CheckpointError(
            f"checkpoint {folder} holds both {SINGLE_FILE} and {INDEX_FILE}: frameworks "
            f"disagree on which is the checkpoint (transformers loads {SINGLE_FILE}, "
            "vLLM the files the index names); remove the other"
        )
    if index_file.exists():
        try:
            weight_map = msgspec.json.decode(index_file.read_bytes(), type=dict[str, Any])
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"cannot read {index_file}: {exc}") from None
        files = weight_map.get("weight_map")
        if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
            raise CheckpointError(f"{index_file} has no weight_map of tensor names to files")
        return sorted(set(files.values()))
    if (folder / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    return sorted(path.name for path in folder.glob("*.safetensors"))
