"""Host memory page-locked in place for CUDA (cudaHostRegister), for memory that torch's
pinned allocator does not make: shared-memory segments (ours, and read-only mappings of
a peer's) and buffers whose exact size matters. Copies between such memory and a GPU go
by DMA and asynchronously; from pageable memory the driver copies through bounce
buffers and blocks the host, several times slower (docs/cuda.md, the host side).

A refused registration leaves the error as CUDA's last error, which the next kernel
launch check (torch's cudaGetLastError) would report as its own failure: page_lock
clears it, and the memory stays pageable.
"""

from __future__ import annotations

import logging

import torch

from zmqworker.distributed.cuda_libs import runtime

log = logging.getLogger(__name__)

PORTABLE = 1  # locked for every CUDA context, not only the current one
READ_ONLY = 8  # the mapping is read-only: the device only reads it


def page_lock(address: int, nbytes: int, device: torch.device, read_only: bool = False) -> bool:
    """Page-lock nbytes at address for device; False where the driver refuses (logged)."""
    flags = PORTABLE | (READ_ONLY if read_only else 0)
    with torch.cuda.device(device):  # not a context made on device 0 by another thread
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))
        if err:
            _clear_last_error()
    if err:
        log.warning("page-locking %d bytes for %s failed (CUDA error %d): copies to and "
                    "from them stay pageable, and slower", nbytes, device, err)  # fmt: skip
    return not err


def page_unlock(address: int, device: torch.device) -> None:
    """Undo page_lock(address, ...) (before the memory is unmapped)."""
    with torch.cuda.device(device):
        if int(torch.cuda.cudart().cudaHostUnregister(address)):
            _clear_last_error()


def _clear_last_error() -> None:
    library = runtime()
    if library is None:
        log.warning("no CUDA runtime library among this process's mappings: a refused "
                    "page-lock's error stays CUDA's last error")  # fmt: skip
        return
    library.cudaGetLastError()
