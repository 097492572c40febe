"""Programmatic dependent launch (PDL) for the Triton kernels of the CUDA step.

A decode step is a chain of a few hundred small kernels, and between two of them the GPU
waits for the next one to launch and spread its programs, about a microsecond even inside
a CUDA graph. Launched with PDL (Hopper and newer), a kernel may be placed on the GPU
while the kernel before it still runs. So every Triton kernel of the step:

- starts with `wait_for_inputs`: it waits until the kernel before it has finished and its
  writes are visible (gdc_wait). Nothing a result depends on is read or written before,
  so a kernel stays correct whatever precedes it (cuBLAS, torch, a kernel that released
  it early), and the caching allocator's reuse of freed memory in stream order stays
  safe;
- calls `release_dependents` once its main loop is done (at once when it has none): the
  next kernel may then launch, and its programs wait on the GPU for this one to end.

Before the wait only hints are given, lines asked into L2 while the kernel before still
ends (`prefetch_lines`), and no result depends on them: the first tiles of a weight
(`prefetch_weights`; no kernel of the step writes a weight), and a one-request decode's
history pages (attention/triton_decode.py), whose places it reads from the step's
sequence length and block table: persistent buffers written before the step's first
kernel, read there only to aim the hint.

Released at the start instead, the next kernel's programs take their places while this
one's still stream their weights, and land unevenly over the multiprocessors: slower
than no PDL at all (docs/cuda.md).

Off on the CPU, in Triton's interpreter, before sm_90, and with ZMQWORKER_PDL=0 (a switch
for measuring it, and for a driver that refuses it in graphs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("ZMQWORKER_PDL", "1") != "0"


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments of a launch of a kernel that takes a PDL constexpr: the
    kernel's own switch and Triton's launch option, on together or off together."""
    on = ENABLED and device.type == "cuda" and _supported(device.index or 0)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A kernel's first statement: the kernel before it has finished, its writes seen."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """The next kernel may launch now; its programs wait for this kernel to end."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


LINE_BYTES = tl.constexpr(128)  # a cache line: one prefetch for each
# The tiles of a weight asked for ahead: those a skinny kernel's pipeline (3 stages)
# loads first.
PREFETCH_TILES = tl.constexpr(2)


@triton.jit
def prefetch_weights(rows, row_ok, k_start, k_end, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Before wait_for_inputs: ask for the first PREFETCH_TILES tiles of BLOCK_K columns
    from k_start (up to k_end) of the weight rows `rows` (pointers to each row's start,
    [rows, 1]; row_ok their mask) in L2. Only for memory no kernel of the step writes:
    the lines may come before the kernel ahead ends. A hint, no load into a register."""
    if PDL:
        per_line: tl.constexpr = LINE_BYTES * 8 // rows.dtype.element_ty.primitive_bitwidth
        offs_k = k_start + tl.arange(0, PREFETCH_TILES * BLOCK_K // per_line) * per_line
        ok = row_ok[:, None] & (offs_k < k_end)[None, :]
        prefetch_lines(rows + offs_k[None, :], ok, rows)  # masked ones: the row's start


@triton.jit
def prefetch_lines(lines, ok, fallback):
    """Ask the lines at `lines` (a pointer a line) into L2; where ok is false, fallback's
    (a valid address of the same shape or a scalar) instead. A hint: nothing is loaded
    into a register, and no result depends on it."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;",
        "=r,l",
        [tl.where(ok, lines, fallback)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
