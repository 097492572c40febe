"""Device memory shared between processes of one host by CUDA IPC handles, raw: an
exporter names an allocation by its handle and a place in it; an importer opens the
handle and reads at that place, until it closes it. torch's own sharing
(`_share_cuda_`) adds reference counters that tie the exporter's memory to every sharing
ever made; a cache that lives as long as its worker, read by peers that come and go,
wants neither.

CUDA keeps an allocation's memory while an importer has it open, even after the
exporter frees it: an importer closes what it no longer reads. A refused call leaves its
error as CUDA's last error, which the next kernel launch check would report as its own:
these calls clear it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from zmqworker.distributed.cuda_libs import driver, runtime

HANDLE_BYTES = 64  # cudaIpcMemHandle_t
LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class IpcError(RuntimeError):
    """A CUDA IPC call refused (the memory cannot be shared, or opened here)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


@dataclass(frozen=True)
class Exported:
    """Where a pointer lies: its allocation's handle, and its offset in it."""

    handle: bytes
    offset: int


@dataclass(frozen=True)
class Opened:
    """An allocation opened in this process: its address here and its size."""

    address: int
    size: int


def export(pointer: int, device: torch.device) -> Exported:
    """The handle of the allocation holding pointer (on device), and pointer's offset."""
    with torch.cuda.device(device):
        handle = _Handle()
        _check(_runtime().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)),
               "cudaIpcGetMemHandle")  # fmt: skip
        base, _ = _range(pointer)
    return Exported(bytes(handle), pointer - base)


def open_handle(handle: bytes, device: torch.device) -> Opened:
    """Open another process's allocation on device (this process's index for the GPU
    that reads it, which may be a peer of the allocation's: peer access is enabled as
    the opening needs it)."""
    if len(handle) != HANDLE_BYTES:
        raise IpcError(f"a CUDA IPC handle of {len(handle)} bytes, not {HANDLE_BYTES}")
    with torch.cuda.device(device):
        address = ctypes.c_void_p()
        raw = _Handle.from_buffer_copy(handle)
        _check(_runtime().cudaIpcOpenMemHandle(ctypes.byref(address), raw, LAZY_PEER_ACCESS),
               "cudaIpcOpenMemHandle")  # fmt: skip
        opened = Opened(address.value or 0, 0)
        try:
            base, size = _range(opened.address)
        except IpcError:
            close_handle(opened, device)
            raise
    return Opened(base, size)


def close_handle(opened: Opened, device: torch.device) -> None:
    with torch.cuda.device(device):
        _check(_runtime().cudaIpcCloseMemHandle(ctypes.c_void_p(opened.address)),
               "cudaIpcCloseMemHandle")  # fmt: skip


def _range(pointer: int) -> tuple[int, int]:
    """The base and size of the allocation holding pointer (the driver's
    cuMemGetAddressRange)."""
    library = driver()
    if library is None:
        raise IpcError("no CUDA driver library among this process's mappings")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = library.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                          ctypes.c_uint64(pointer))  # fmt: skip
    if err:
        raise IpcError(f"cuMemGetAddressRange refused address {pointer:#x} (CUDA error {err})")
    return base.value, size.value


def _runtime() -> ctypes.CDLL:
    library = runtime()
    if library is None:
        raise IpcError("no CUDA runtime library among this process's mappings")
    return library


def _check(err: int, call: str) -> None:
    if err:
        _runtime().cudaGetLastError()
        raise IpcError(f"{call} refused (CUDA error {err})")
