"""The greedy ids of a CUDA graph's step: the argmax of each row of logits, in one Triton
kernel that writes int32 ids where the token feed reads them.

A graph computes the logits of as many rows as its size allows, but writes the ids of
the rows that sample in this step only (a count it reads on the device, uploaded with the
step's inputs): a step that samples nothing must leave the previous samples where they
are, as a later step's token feed still reads them there.

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
    count_ptr,
    logits_ptr,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
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
    at = out_ptr + tl.program_id(0)
    if HAS_COUNT:
        # A row past the step's samples keeps what it holds.
        tl.store(at, best_at.to(tl.int32), mask=tl.program_id(0) < tl.load(count_ptr))
    else:
        tl.store(at, best_at.to(tl.int32))


def greedy_ids(
    logits: torch.Tensor, out: torch.Tensor, count: torch.Tensor | None = None
) -> torch.Tensor:
    """out[r] = argmax(logits[r]) (the first largest) for logits [n, vocab] with a unit
    last stride; out: int32 [n]. count: int32 [1] on the device; only the rows below
    count[0] are written (None: all). Returns out."""
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
    if count is not None and (
        count.dtype != torch.int32 or count.numel() != 1 or count.device != logits.device
    ):
        raise ValueError(
            f"count must be one int32 on {logits.device}, got {count.dtype} "
            f"{tuple(count.shape)} on {count.device}"
        )
    if rows == 0:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    _greedy_ids_kernel[(rows,)](
        out,
        out if count is None else count,
        logits,
        vocab,
        logits.stride(0),
        CHUNK=chunk,
        NUM_CHUNKS=triton.cdiv(vocab, chunk),
        HAS_COUNT=count is not None,
        num_warps=NUM_WARPS,
        **launch_options(logits.device),
    )
    return out
