"""The one rule for every array field the protocol declares int32 (the step's token ids,
block ids and columns, a grammar output's handles and bitmask): any integer dtype is
taken and converted, so that an engine may write int64; a value int32 cannot hold is
refused, never cut (a 64-bit handle past 2**31 would name another request); bool and
floats are refused. Every refusal names the field."""

from __future__ import annotations

import numpy as np

_INT32 = np.iinfo(np.int32)


def int32_array(values: object, name: str, ndim: int) -> np.ndarray:
    """values as an int32 array of ndim dimensions (the same array when it is one)."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {list(array.shape)}")
    if array.dtype.itemsize > 4 or array.dtype == np.uint32:
        outside = (array < _INT32.min) | (array > _INT32.max)
        if outside.any():
            raise ValueError(f"{name}: {array[outside][0]} does not fit in int32")
    return array.astype(np.int32, copy=False)
