"""Host arrays to the device without a host synchronisation.

A copy from pageable memory makes the host wait for the device; from pinned memory with
non_blocking it is queued like a kernel. torch's pinned allocator keeps the staging memory
until the copy has run, so a caller may drop it at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
