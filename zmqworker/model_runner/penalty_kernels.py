"""The penalties' Triton kernels (the CUDA step's; penalties.py has the torch twins that
the CPU runs, and that these must equal).

- apply_dense: the repetition, frequency and presence penalties over whole rows of
  logits, reading each request's output counts and prompt bits once, in place: one pass
  over [rows, vocab] instead of the half dozen of the torch ops.
- add_entries: sparse (batch row, token, value) edits of the logits rows that sample
  (logit_bias, and the -inf of banned tokens).
- count_outputs: each sampled token counted in its request's row of output counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs

_DENSE_BLOCK = 2048
_ENTRY_BLOCK = 256


# One binary whatever the step: the counts a step has, and whether it reads the prompt
# bits, are values (an int argument of 1 would be specialised), and every pointer is
# 16-byte aligned (penalty_rows.upload pads its arrays), as Triton specialises that too.
@triton.jit(do_not_specialize=["num_rows", "repetition"])
def _dense_kernel(
    logits_ptr,
    logits_stride,
    counts_ptr,
    bits_ptr,
    index_ptr,
    rows_ptr,
    penalties_ptr,
    num_rows,
    vocab,
    words,
    repetition,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    i = tl.program_id(0)
    at = tl.load(index_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    repetition = tl.load(penalties_ptr + i)
    frequency = tl.load(penalties_ptr + num_rows + i)
    presence = tl.load(penalties_ptr + 2 * num_rows + i)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    logits = tl.load(logits_ptr + at * logits_stride + offs, mask=ok, other=0.0)
    counts = tl.load(counts_ptr + row * vocab + offs, mask=ok, other=0)
    in_output = counts > 0
    seen = in_output
    if repetition != 0:
        word = tl.load(bits_ptr + row * words + offs // 32, mask=ok, other=0)
        seen = seen | (((word >> (offs % 32)) & 1) != 0)
    penalized = tl.where(logits > 0, logits / repetition, logits * repetition)
    logits = tl.where(seen, penalized, logits)
    logits = logits - frequency * counts.to(tl.float32)
    logits = logits - presence * in_output.to(tl.float32)
    tl.store(logits_ptr + at * logits_stride + offs, logits, mask=ok)


@triton.jit(do_not_specialize=["num_entries"])
def _entries_kernel(
    logits_ptr,
    logits_stride,
    index_of_row_ptr,
    rows_ptr,
    tokens_ptr,
    values_ptr,
    num_entries,
    BLOCK: tl.constexpr,
    HAS_VALUES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_entries
    row = tl.load(rows_ptr + offs, mask=ok, other=0)
    at = tl.load(index_of_row_ptr + row, mask=ok, other=-1)
    ok = ok & (at >= 0)
    token = tl.load(tokens_ptr + offs, mask=ok, other=0)
    if HAS_VALUES:
        value = tl.load(values_ptr + offs, mask=ok, other=0.0)
    else:
        value = tl.full([BLOCK], float("-inf"), tl.float32)
    # A (row, token) is edited once per launch, or (bans) always to -inf: no race matters.
    ptr = logits_ptr + at.to(tl.int64) * logits_stride + token
    tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + value, mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _count_kernel(
    counts_ptr,
    vocab,
    sampled_ptr,
    index_ptr,
    rows_ptr,
    num_rows,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_rows
    at = tl.load(index_ptr + offs, mask=ok, other=0)
    row = tl.load(rows_ptr + offs, mask=ok, other=0).to(tl.int64)
    token = tl.load(sampled_ptr + at, mask=ok, other=0)
    # The rows are distinct requests: no two programs touch one count.
    ptr = counts_ptr + row * vocab + token
    tl.store(ptr, tl.load(ptr, mask=ok, other=0) + 1, mask=ok)


def apply_dense(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_bits: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    penalties: torch.Tensor,
    repetition: bool,
) -> None:
    """Penalise logits[index[i]] by the request in batch row rows[i]: penalties float32
    [3, p] (repetition, frequency, presence); counts int32 [R, vocab], prompt_bits int32
    [R, ceil(vocab / 32)]; index and rows int32 [p]."""
    num_rows, vocab = index.numel(), logits.shape[1]
    if num_rows == 0:
        return
    _dense_kernel[(num_rows, triton.cdiv(vocab, _DENSE_BLOCK))](
        logits,
        logits.stride(0),
        counts,
        prompt_bits,
        index,
        rows,
        penalties,
        num_rows,
        vocab,
        prompt_bits.shape[1],
        int(repetition),
        BLOCK=_DENSE_BLOCK,
        num_warps=8,
        **launch_options(logits.device),
    )


def add_entries(
    logits: torch.Tensor,
    index_of_row: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    values: torch.Tensor | None,
) -> None:
    """logits[index_of_row[rows[e]], tokens[e]] += values[e] (-inf without values) where
    index_of_row[rows[e]] >= 0; all int32 but values float32."""
    num_entries = rows.numel()
    if num_entries == 0:
        return
    _entries_kernel[(triton.cdiv(num_entries, _ENTRY_BLOCK),)](
        logits,
        logits.stride(0),
        index_of_row,
        rows,
        tokens,
        rows if values is None else values,
        num_entries,
        BLOCK=_ENTRY_BLOCK,
        HAS_VALUES=values is not None,
        **launch_options(logits.device),
    )


def count_outputs(
    counts: torch.Tensor, sampled: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
) -> None:
    """counts[rows[i], sampled[index[i]]] += 1 for distinct rows (all int32)."""
    num_rows = index.numel()
    if num_rows == 0:
        return
    _count_kernel[(triton.cdiv(num_rows, _ENTRY_BLOCK),)](
        counts,
        counts.shape[1],
        sampled,
        index,
        rows,
        num_rows,
        BLOCK=_ENTRY_BLOCK,
        **launch_options(counts.device),
    )
