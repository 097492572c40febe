"""Many pieces of host memory copied in one call: process_vm_readv aimed at this process's
own pid reads a list of ranges into another list of ranges in the kernel, without the
GIL, so that a copy of hundreds of scattered blocks is a call a layer, not a Python
statement a block (a call per IOV_MAX pieces), and the layers' calls run side by side on
threads (blocks.py's for_each_layer). A process may always read its own memory this way:
it needs no ptrace permission.

On one thread, slices of byte memoryviews (one piece at a time, under the GIL) copy
faster than the kernel's call (docs/kv_transfer.md), and so they do where torch computes
on one thread or the kernel refuses the call (a seccomp filter, a kernel without it).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import numpy as np
import torch

_IOV_MAX = os.sysconf("SC_IOV_MAX")


def copy_pieces(
    dst: torch.Tensor, src: torch.Tensor, to: np.ndarray, at: np.ndarray, lengths: np.ndarray
) -> None:
    """Bytes at[i] .. at[i] + lengths[i] - 1 of src into to[i] .. of dst, for every i
    (dst and src contiguous host tensors; the arrays of one length). ValueError where a
    piece lies outside either tensor, before anything is copied; OSError where the
    kernel fails the copy."""
    for t in (dst, src):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"a {t.device.type} tensor of strides {t.stride()} copied as bytes")
    to, at, lengths = (np.asarray(a, dtype=np.int64) for a in (to, at, lengths))
    if not (len(to) == len(at) == len(lengths)):
        raise ValueError(f"{len(to)} destinations, {len(at)} sources, {len(lengths)} lengths")
    if not len(to):
        return
    for name, starts, t in (("destination", to, dst), ("source", at, src)):
        # Compared without a sum, which could wrap past int64 into a passing negative.
        if (starts.min() < 0 or lengths.min() < 0 or lengths.max() > t.nbytes
                or (starts > t.nbytes - lengths).any()):  # fmt: skip
            raise ValueError(f"a {name} piece outside the {t.nbytes} bytes it lies in")
    if in_kernel():
        for start in range(0, len(to), _IOV_MAX):
            part = slice(start, start + _IOV_MAX)
            _read(dst.data_ptr(), src.data_ptr(), to[part], at[part], lengths[part])
        return
    dst_bytes, src_bytes = _bytes(dst), _bytes(src)
    for d, s, n in zip(to.tolist(), at.tolist(), lengths.tolist(), strict=True):
        dst_bytes[d : d + n] = src_bytes[s : s + n]


def in_kernel() -> bool:
    """Whether copy_pieces copies in the kernel's call (else in slices, one at a time)."""
    return torch.get_num_threads() > 1 and _kernel_takes_it()


@functools.cache
def _kernel_takes_it() -> bool:
    if not hasattr(os, "memfd_create"):  # not Linux
        return False
    probe, into = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    try:
        _read(into.data_ptr(), probe.data_ptr(), np.array([0]), np.array([0]), np.array([8]))
    except (OSError, AttributeError):
        return False
    return torch.equal(into, probe)


@functools.cache
def _readv() -> Callable[..., int]:
    call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                     ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    return call


def _read(dst: int, src: int, to: np.ndarray, at: np.ndarray, lengths: np.ndarray) -> None:
    """One process_vm_readv of up to IOV_MAX pieces (checked by the caller)."""
    local, remote = np.empty((len(to), 2), np.uint64), np.empty((len(at), 2), np.uint64)
    local[:, 0], remote[:, 0] = dst + to.astype(np.uint64), src + at.astype(np.uint64)
    local[:, 1] = remote[:, 1] = lengths
    wanted = int(lengths.sum())
    got = _readv()(os.getpid(), local.ctypes.data, len(local), remote.ctypes.data,
                   len(remote), 0)  # fmt: skip
    if got != wanted:
        errno = ctypes.get_errno() if got < 0 else 0
        raise OSError(errno, f"process_vm_readv copied {got} of {wanted} bytes: "
                      f"{os.strerror(errno) if errno else 'a short copy'}")  # fmt: skip


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
