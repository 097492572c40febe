"""Devices as a client sees them before anything starts, without importing torch (seconds
of start-up): how many GPUs this host shows, what device="auto" and dtype="auto" become,
and whether a layout's ranks fit the GPUs.

A GPU is visible when the driver made its device node (/dev/nvidiaN) and
CUDA_VISIBLE_DEVICES, when set, lists it: as CUDA reads that variable, the list ends at
its first negative entry ("-1" hides every GPU).
"""

from __future__ import annotations

import os
import re

from zmqworker.transport.spawn_env import SHARE_GPUS_ENV

_NODE = re.compile(r"nvidia\d+")
# What "auto" makes of a checkpoint's dtype on CUDA: float32 weights run in bfloat16.
_CUDA_DTYPES = {"float32": "bfloat16", "bfloat16": "bfloat16", "float16": "float16"}


def visible_gpu_count() -> int:
    try:
        nodes = sum(1 for name in os.listdir("/dev") if _NODE.fullmatch(name))
    except OSError:
        return 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return nodes
    count = 0
    for entry in listed.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, nodes)


def resolve_device(device: str, gpus: int) -> tuple[str, str]:
    """The device the workers use, and why: "auto" is CUDA when a GPU is visible."""
    if device != "auto":
        return device, "asked"
    if gpus:
        return "cuda", f"auto: {gpus} GPU(s) visible"
    return "cpu", "auto: no GPU visible"


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: object) -> tuple[str, str]:
    """The workers' dtype, and why: "auto" is float32 on the CPU, and on CUDA the
    checkpoint's dtype (bfloat16 where it says float32, or says nothing)."""
    if dtype != "auto":
        return dtype, "asked"
    if device == "cpu":
        return "float32", "auto: float32 on the CPU"
    saved = checkpoint_dtype if isinstance(checkpoint_dtype, str) else None
    chosen = _CUDA_DTYPES.get(saved or "", "bfloat16")
    return chosen, f"auto: the checkpoint's {saved or 'unstated dtype'} on CUDA"


def gpu_range(first: int, count: int) -> str:
    """GPUs first .. first + count - 1, as a log line names them."""
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def check_gpu_layout(dp: int, tp: int, pp: int, gpus: int) -> None:
    """Refuse more ranks on this host than GPUs visible, unless SHARE_GPUS_ENV allows
    ranks to share them."""
    ranks = dp * tp * pp
    if ranks <= gpus or os.environ.get(SHARE_GPUS_ENV) == "1":
        return
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    raise ValueError(
        f"data_parallel_size={dp} x tensor_parallel_size={tp} x pipeline_parallel_size={pp} "
        f"is {ranks} ranks, but {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES={listed}): "
        f"give every rank a GPU of its own, or set {SHARE_GPUS_ENV}=1 to let ranks share them"
    )
