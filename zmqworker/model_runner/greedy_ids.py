"""The greedy ids of a CUDA graph's step: the argmax of each row of logits, in one Triton
kernel that writes int32 ids where the token feed reads them.

torch's argmax reduces a row in one block that walks it serially, and then a second
kernel narrows the int64 ids: a visible share of a small model's step (docs/cuda.md).
Here one program takes a row
in chunks of CHUNK logits, unrolled so that their loads are all in flight at once, and
keeps the first largest, as torch does (NaN counts as +inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs

CHUNK = 8192
NUM_WARPS = 16


@triton.jit
def _greedy_ids_kernel(
    out_ptr,
    logits_ptr,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    row = logits_ptr + tl.program_id(0).to(tl.int64) * stride_row
    offs = tl.arange(0, CHUNK)
    best = float("-inf")
    best_at = 0
    for c in tl.static_range(NUM_CHUNKS):
        at = c * CHUNK + offs
        values = tl.load(row + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        # NaN counts as +inf: it wins over any number, as in torch.
        values = tl.where(values != values, float("inf"), values)
        top, top_at = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)
        # Strictly larger: on a tie the earlier chunk keeps it. An all -inf row gives 0.
        better = top > best
        best_at = tl.where(better, c * CHUNK + top_at, best_at)
        best = tl.where(better, top, best)
    tl.store(out_ptr + tl.program_id(0), best_at.to(tl.int32))


def greedy_ids(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = argmax(logits[r]) (the first largest) for logits [n, vocab] with a unit
    last stride; out: int32 [n]. Returns out."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"greedy_ids needs logits [n, vocab] with a unit last stride, got "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    rows, vocab = logits.shape
    if out.dtype != torch.int32 or out.shape != (rows,) or out.device != logits.device:
        raise ValueError(
            f"out must be int32 [{rows}] on {logits.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if rows == 0:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    _greedy_ids_kernel[(rows,)](
        out,
        logits,
        vocab,
        logits.stride(0),
        CHUNK=chunk,
        NUM_CHUNKS=triton.cdiv(vocab, chunk),
        num_warps=NUM_WARPS,
        **launch_options(logits.device),
    )
    return out
