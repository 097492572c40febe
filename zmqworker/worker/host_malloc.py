"""glibc's malloc told to keep a CPU step's large temporaries instead of giving them back.

A CPU step's activations are blocks of megabytes (a 2,048-token prefill of SmolLM2: 25 MB
for the MLP's gate and up projections alone). glibc serves a block above its mmap
threshold with a fresh mapping, and gives the top of its heap back to the kernel once
more than its trim threshold is free there; both thresholds adapt to the sizes seen, and
a step's mix of sizes keeps them behind, so every step page-faults its memory in again.
On the 2-core CI machine the first 2,048-token prefill of a worker spent 2.7 s of its
5.3 s in the kernel (219k page faults); with the threshold at glibc's ceiling and no
trimming, 1.2-2.1 s (62k-144k faults, mostly the first touch), and later steps fault
little.

The worker sets this once it has warmed up, not at start: memory that is touched once
(the weights, the KV cache) comes faster from fresh mappings, and with the settings in
place from the start the worker was ready about a second later.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
NO_TRIM = (1 << 31) - 1  # the largest value mallopt takes: free heap stays mapped


def keep_freed_memory() -> bool:
    """Set the process's malloc to reuse freed blocks up to 32 MB without returning them
    to the kernel. False where the C library has no mallopt (musl, macOS): then nothing
    changes."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, NO_TRIM)
    )
