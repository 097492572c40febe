"""Message equality for tests and benchmarks: exact, and naming the first difference."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "message") -> None:
    """Raise AssertionError naming the first place where a and b differ. Arrays and
    tensors must match in type, dtype, shape and every byte; floats bit for bit; other
    scalars in type and value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert _tensor_bytes(a) == _tensor_bytes(b), f"{path}: tensor contents differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: ndarray vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (
            f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert a.tobytes() == b.tobytes(), f"{path}: array contents differ"
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b).__name__}"
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        same = type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)
        assert same, f"{path}: {a!r} vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
