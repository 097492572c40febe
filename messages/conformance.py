"""A decoded message as plain JSON: what a reader in any language should make of a
golden fixture, written beside it as messages/fixtures/<name>.json by
messages/make_fixtures.py (docs/protocol.md, "Conformance", describes the form).

A struct is an object: "type" (its name), then every field in declaration order,
defaults included. A map is an object, a list an array. An array or tensor is an object
{"array": "numpy" (ext 1, 2) or "torch" (ext 3, 4), "dtype", "shape", "values": its
elements flat, in C order}; float16 and bfloat16 values are their raw bits as unsigned
16-bit integers, float32 values the double they equal. JSON has no number for infinity or
NaN: a float that is not finite (a logprob of -inf) is the string "inf", "-inf" or "nan".
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import numpy as np
import torch

from messages.codec import DTYPE_NAMES
from messages.version import PROTOCOL_VERSION

_BITS_16 = (torch.float16, torch.bfloat16)


def plain(value: Any) -> Any:
    """value (a message, or anything inside one) as JSON-ready Python values."""
    if isinstance(value, msgspec.Struct):
        fields = {name: plain(getattr(value, name)) for name in value.__struct_fields__}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, np.ndarray):
        return _array("numpy", str(value.dtype), value.shape, value)
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous()
        if flat.dtype in _BITS_16:
            flat = flat.view(torch.int16).numpy().view(np.uint16)
        else:
            flat = flat.numpy()
        return _array("torch", str(value.dtype).removeprefix("torch."), value.shape, flat)
    if isinstance(value, dict):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, float):
        return _float(value)
    return value


def _float(value: float) -> float | str:
    """value, or the string that stands for it where JSON has no number."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _array(kind: str, dtype: str, shape: tuple[int, ...], values: np.ndarray) -> dict:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} has no wire code")
    flat = values.ravel().tolist()
    if values.dtype.kind == "f":
        flat = [_float(v) for v in flat]
    return {"array": kind, "dtype": dtype, "shape": list(shape), "values": flat}


def conformance_json(msg: Any, num_data_frames: int) -> str:
    """The text of a fixture's JSON file: the protocol version, how many data frames
    follow the body, and the message."""
    document = {"version": PROTOCOL_VERSION, "data_frames": num_data_frames, "message": plain(msg)}
    return _dumps(document, 0) + "\n"


def _dumps(value: Any, depth: int) -> str:
    """JSON indented by structure, with every list of plain values on one line (an
    array's values stay one line, however long)."""
    inner, outer = "  " * (depth + 1), "  " * depth
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [inner + _dumps(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + f"\n{outer}]"
    return json.dumps(value, allow_nan=False)
