"""A worker extension for the CUDA tests: torch's sync-debug mode in the worker process,
so that an update that makes the host wait for the device fails there."""

from __future__ import annotations

import torch


class SyncDebug:
    def set_sync_debug_mode(self, mode: str) -> None:
        """ "default", "warn" or "error" (torch.cuda.set_sync_debug_mode)."""
        torch.cuda.set_sync_debug_mode(mode)

    def device_memory_in_use(self) -> int:
        """Bytes this worker's allocator holds on its device."""
        return torch.cuda.memory_reserved()
