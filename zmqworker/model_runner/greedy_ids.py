"""The greedy ids of a CUDA graph's step: the argmax of each row of logits, in one Triton
kernel that writes int32 ids where the token feed reads them.

A graph computes the logits of as many rows as its size allows, but writes the ids of
the rows that sample in this step only (a count it reads on the device, uploaded with the
step's inputs): a step that samples nothing must leave the previous samples where they
are, as a later step's token feed still reads them there.

torch's argmax reduces a row in one block that walks it serially, and then a second
kernel narrows the int64 ids: a visible share of a small model's step (docs/cuda.md).
Here a row is split over programs of CHUNK logits each, so that a batch-1 step's row
streams through many multiprocessors, not one. Each program writes its chunk's first
largest and where it is; the row's last program to finish (an atomic counter per row
tells it) takes the first largest of those, chunks in order, and writes the id: the first
largest of the row, as torch keeps (NaN counts as +inf). One launch, not two.

The counters are a persistent int32 buffer (GreedyIds), zero at rest: the last program
sets its row's back to zero, so CUDA graphs replay over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs

CHUNK = 4096
NUM_WARPS = 4


@triton.jit
def _greedy_ids_kernel(
    out_ptr,
    count_ptr,
    logits_ptr,
    top_ptr,
    top_at_ptr,
    counters_ptr,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    NUM_CHUNKS_P: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows_written = 2147483647
    if HAS_COUNT:  # a row past the step's samples keeps what it holds: none of its
        rows_written = tl.load(count_ptr)  # programs runs
    if row < rows_written:
        at = chunk * CHUNK + tl.arange(0, CHUNK)
        logits = logits_ptr + row.to(tl.int64) * stride_row
        values = tl.load(logits + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        release_dependents(PDL)
        # NaN counts as +inf: it wins over any number, as in torch.
        values = tl.where(values != values, float("inf"), values)
        top, top_at = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)
        part = row * NUM_CHUNKS + chunk
        tl.store(top_ptr + part, top)
        tl.store(top_at_ptr + part, chunk * CHUNK + top_at)
        tl.debug_barrier()  # the chunk's result comes before the one thread's release
        counter = counters_ptr + row
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_CHUNKS - 1:
            tl.store(counter, 0)
            chunks = tl.arange(0, NUM_CHUNKS_P)
            ok = chunks < NUM_CHUNKS
            parts = row * NUM_CHUNKS + chunks
            tops = tl.load(top_ptr + parts, mask=ok, other=float("-inf"))
            ats = tl.load(top_at_ptr + parts, mask=ok, other=0)
            # On a tie the earlier chunk keeps it; an all -inf row gives chunk 0's first: 0.
            _, first = tl.max(tops, 0, return_indices=True, return_indices_tie_break_left=True)
            best_at = tl.sum(tl.where(chunks == first, ats, 0), 0)
            tl.store(out_ptr + row, best_at.to(tl.int32))


class GreedyIds:
    """The argmax kernel of up to max_rows rows, with its counters."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self._counters = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def __call__(
        self, logits: torch.Tensor, out: torch.Tensor, count: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out[r] = argmax(logits[r]) (the first largest) for logits [n <= max_rows, vocab]
        with a unit last stride; out: int32 [n]. count: int32 [1] on the device; only the
        rows below count[0] are written (None: all). Returns out."""
        if logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError(
                f"greedy ids need logits [n, vocab] with a unit last stride, got "
                f"{tuple(logits.shape)} strides {logits.stride()}"
            )
        rows, vocab = logits.shape
        if rows > len(self._counters) or logits.device != self._counters.device:
            raise ValueError(
                f"greedy ids of {rows} rows on {logits.device}: this kernel takes up to "
                f"{len(self._counters)} rows on {self._counters.device}"
            )
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
        if rows == 0 or vocab == 0:
            return out
        chunks = triton.cdiv(vocab, CHUNK)
        top = torch.empty(rows * chunks, dtype=torch.float32, device=logits.device)
        top_at = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
        _greedy_ids_kernel[(rows, chunks)](
            out,
            out if count is None else count,
            logits,
            top,
            top_at,
            self._counters,
            vocab,
            logits.stride(0),
            CHUNK=CHUNK,
            NUM_CHUNKS=chunks,
            NUM_CHUNKS_P=triton.next_power_of_2(chunks),
            HAS_COUNT=count is not None,
            num_warps=NUM_WARPS,
            **launch_options(logits.device),
        )
        return out
