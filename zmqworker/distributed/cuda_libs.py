"""The CUDA runtime and driver libraries torch loaded, through ctypes, for the calls
torch does not wrap (torch.cuda.cudart() has a few runtime calls, the driver none)."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """libcudart, as mapped in this process (None where torch has not loaded it)."""
    return _mapped("/libcudart")


@functools.cache
def driver() -> ctypes.CDLL | None:
    """libcuda, as mapped in this process (None before CUDA is initialized)."""
    return _mapped("/libcuda.so")


def _mapped(name: str) -> ctypes.CDLL | None:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if name in line}
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
