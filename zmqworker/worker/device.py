"""What differs between devices: selection, memory accounting, synchronisation.

The torch Worker is written against DeviceOps; a new device implements one subclass.
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager, nullcontext

import psutil
import torch

from zmqworker.transport.spawn_env import SHARE_GPUS_ENV


class DeviceOps:
    """Host (CPU) behaviour; the base for every device."""

    name = "cpu"
    dist_backend = "gloo"

    def select(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        """Wait for queued device work; nothing is queued on the CPU."""

    def on(self, device: torch.device) -> AbstractContextManager[object]:
        """The calling thread on device (a new thread starts on the first GPU)."""
        return nullcontext()

    def empty_cache(self) -> None:
        """Return cached device memory to the system; the CPU keeps no cache."""

    def release_workspaces(self) -> None:
        """Let the math libraries' workspaces go (made again by their next call): only
        while no captured graph uses them. The CPU's libraries keep none."""

    def free_and_total_bytes(self) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def reset_peak(self) -> int:
        """Start a peak measurement; returns the bytes in use now."""
        _reset_peak_rss()
        return psutil.Process().memory_info().rss

    def peak_bytes(self) -> int:
        """Peak bytes in use since reset_peak (VmHWM: psutil has no peak that resets)."""
        return _peak_rss_bytes()


class CudaOps(DeviceOps):
    name = "cuda"
    dist_backend = "nccl"

    def select(self, local_rank: int) -> torch.device:
        # CUDA_VISIBLE_DEVICES is honoured by torch itself: the visible GPUs are 0..n-1.
        count = torch.cuda.device_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        if count == 0:
            raise RuntimeError(
                f"device=cuda but no GPU is visible (CUDA_VISIBLE_DEVICES={visible})"
            )
        if local_rank >= count and os.environ.get(SHARE_GPUS_ENV) != "1":
            raise RuntimeError(
                f"local rank {local_rank} has no GPU of its own: {count} visible "
                f"(CUDA_VISIBLE_DEVICES={visible}); set {SHARE_GPUS_ENV}=1 to share them"
            )
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
        return device

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def on(self, device: torch.device) -> AbstractContextManager[object]:
        return torch.cuda.device(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def release_workspaces(self) -> None:
        # cuBLAS keeps a workspace for each stream it ran on (capture streams included).
        torch._C._cuda_clearCublasWorkspaces()

    def free_and_total_bytes(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def reset_peak(self) -> int:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated()


def device_ops(device: str) -> DeviceOps:
    """auto picks CUDA when a GPU is visible."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return DeviceOps()
    if device == "cuda":
        return CudaOps()
    raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        # Without it (old kernels, some sandboxes) VmHWM stays the lifetime peak: the
        # measurement errs on the large side, which only shrinks the KV cache.
        return
