"""The shared memory a Triton program may take on a device, for tile settings whose
software pipeline must fit it (models/layers/fused_moe.py, skinny_gate_up.py)."""

from __future__ import annotations

import functools
import os

import triton


@functools.cache
def shared_memory(device_index: int) -> int | None:
    """The most shared memory a program may take on the device, as Triton's driver reports
    it: 227 KiB on Hopper, 163 KiB on an A100, 99 KiB on Ada and consumer Ampere. None in
    Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return properties["max_shared_mem"]
