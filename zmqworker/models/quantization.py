"""Quantized checkpoints, found and refused: the workers run plain floating-point weights
only, and a quantized tensor cast to float is a wrong weight, not a slow one.

A checkpoint is quantized when its config says so (config.json's quantization_config, or
a quantize_config.json / quant_config.json beside it, as AutoGPTQ and AutoAWQ write) or
when its tensors show it (float8 or integer weights, or the scales, zero points and packed
weights that quantization methods store beside them), whatever its config says.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from zmqworker.models.checkpoint_files import CheckpointError, SafetensorsFiles, TensorHeader

# safetensors dtypes the loader casts into a float parameter as they are.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_REFUSAL = (
    "quantized checkpoints are not supported; supported: plain float32, bfloat16 or "
    "float16 safetensors weights (an unquantized checkpoint of the model)"
)
_CONFIG_KEYS = ("quantization_config", "compression_config")
_SIDE_FILES = ("quantize_config.json", "quant_config.json")
# The last part of a tensor name that only quantization methods write (fp8 and
# compressed-tensors: weight_scale, input_scale, ...; GPTQ and AWQ: qweight, qzeros, scales,
# g_idx; bitsandbytes: SCB, absmax, quant_map).
_QUANTIZATION_NAMES = frozenset(
    {
        "weight_scale",
        "weight_scale_inv",
        "weight_scale_2",
        "weight_zero_point",
        "weight_global_scale",
        "weight_packed",
        "weight_shape",
        "input_scale",
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "SCB",
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
    }
)
# ... and the names of the packed weights themselves.
_WEIGHT_NAMES = frozenset({"weight", "qweight", "weight_packed"})
_DTYPE_NAMES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}


def dtype_name(dtype: str) -> str:
    """A safetensors dtype as torch names it (F8_E4M3: float8_e4m3fn)."""
    return _DTYPE_NAMES.get(dtype, dtype)


def refuse_quantized(folder: Path, config: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming the quantization method, and where it was found, or a
    quantized tensor and its dtype; config is the folder's config.json."""
    refuse_quantized_config(folder, config)
    refuse_quantized_tensors(SafetensorsFiles.read(folder))


def refuse_quantized_config(folder: Path, config: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming the quantization method the config (config.json's
    quantization_config or compression_config, or a side file) gives, and where."""
    found = quantization_method(folder, config)
    if found is not None:
        method, where = found
        raise CheckpointError(
            f"checkpoint {folder} is quantized ({method}, in {where}): {_REFUSAL}"
        )


def refuse_quantized_tensors(files: SafetensorsFiles) -> None:
    """Raise CheckpointError naming a tensor whose dtype or name shows quantized weights."""
    found = quantized_tensor(files.tensors())
    if found is not None:
        name, header = found
        raise CheckpointError(
            f"checkpoint {files.folder} is quantized (tensor {name} is "
            f"{dtype_name(header.dtype)}): {_REFUSAL}"
        )


def quantization_method(folder: Path, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(the method, the file (and key) that names it), or None for a plain checkpoint."""
    for key in _CONFIG_KEYS:
        section = config.get(key)
        if section:
            method = _method_of(section, "no quant_method given")
            return method, f"config.json's {key}"
    for name in _SIDE_FILES:
        path = folder / name
        if path.is_file():
            try:
                section = msgspec.json.decode(path.read_bytes())
            except msgspec.DecodeError:
                section = None
            # AutoGPTQ's file and AutoAWQ's name no method; AWQ's says w_bit.
            guess = "awq" if name == "quant_config.json" else "gptq"
            if isinstance(section, dict) and "w_bit" in section:
                guess = "awq"
            return _method_of(section, guess), name
    return None


def quantized_tensor(tensors: Mapping[str, TensorHeader]) -> tuple[str, TensorHeader] | None:
    """A tensor that shows quantized weights, None when there is none: first (by name) a
    quantized weight itself (float narrower than 16 bits anywhere, or an integer weight),
    else a tensor only a quantization method writes (a scale, zero point, group index).
    Integer buffers that are not weights (position ids) are no quantization."""
    ranked = [(rank, name) for name in tensors if (rank := _rank(name, tensors[name])) is not None]
    if not ranked:
        return None
    name = min(ranked)[1]
    return name, tensors[name]


def _rank(name: str, header: TensorHeader) -> int | None:
    last = name.rsplit(".", 1)[-1]
    plain = header.dtype in FLOAT_DTYPES
    if not plain and (header.dtype.startswith("F") or last in _WEIGHT_NAMES):
        return 0
    if last in _QUANTIZATION_NAMES or ".quant_state." in name:
        return 1
    return None


def _method_of(section: Any, default: str) -> str:
    if isinstance(section, dict):
        for key in ("quant_method", "checkpoint_format"):
            if isinstance(section.get(key), str):
                return section[key]
    return default
