"""Host arrays to the device without a host synchronisation.

A copy from pageable memory makes the host wait for the device; from pinned memory with
non_blocking it is queued like a kernel. torch's pinned allocator keeps the staging memory
until the copy has run, so a caller may drop it at once.
"""

from __future__ import annotations

import numpy as np
import torch

from zmqworker.cdiv import cdiv

_ALIGN = 4  # int32 elements: 16 bytes


def to_device(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int32 and float32 arrays to the device in one copy: a view of each there, of its
    dtype and shape, each starting 16 bytes aligned (Triton specialises on that)."""
    starts = np.cumsum([0] + [cdiv(a.size, _ALIGN) * _ALIGN for a in arrays])
    flat = np.zeros(int(starts[-1]), np.int32)
    for array, start in zip(arrays, starts, strict=False):
        flat[start : start + array.size] = np.ascontiguousarray(array).view(np.int32).ravel()
    buffer = to_device(flat, torch.int32, device)
    views = []
    for array, start in zip(arrays, starts, strict=False):
        view = buffer[start : start + array.size]
        if array.dtype == np.float32:
            view = view.view(torch.float32)
        views.append(view.view(array.shape))
    return views
