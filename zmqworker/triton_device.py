"""What a device gives Triton programs, for the tile settings that depend on it
(models/layers/fused_moe.py, skinny_gate_up.py): the shared memory a program may take,
which a software pipeline's stages must fit (fit_stages), and the multiprocessors, which
decide whether a grid's programs run in one wave."""

from __future__ import annotations

import functools
import os

import triton


@functools.cache
def _properties(device_index: int) -> dict | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return triton.runtime.driver.active.utils.get_device_properties(device_index)


def shared_memory(device_index: int) -> int | None:
    """The most shared memory a program may take on the device, as Triton's driver reports
    it: 227 KiB on Hopper, 163 KiB on an A100, 99 KiB on Ada and consumer Ampere. None in
    Triton's interpreter."""
    properties = _properties(device_index)
    return None if properties is None else properties["max_shared_mem"]


def multiprocessors(device_index: int) -> int | None:
    """The device's multiprocessors (132 on an H100 SXM or H200, 114 on an H100 PCIe, 108
    on an A100). None in Triton's interpreter."""
    properties = _properties(device_index)
    return None if properties is None else properties["multiprocessor_count"]


def fit_stages(stages: int, stage_bytes: int, shared_bytes: int | None) -> int:
    """The most software-pipeline stages, from `stages` down to 2, whose buffers
    (stage_bytes each) fit in shared_bytes (None: no limit known). Every stage is counted:
    Triton keeps num_stages - 1 of them on some targets and all of them on others (sm_90
    at 64 half-precision rows), and the count must hold on both."""
    while shared_bytes is not None and stages > 2 and stages * stage_bytes > shared_bytes:
        stages -= 1
    return stages
