"""The grammar bitmask on the CUDA step's logits: each program reads the packed words that
cover a block of one row and writes -inf where a token's bit is 0, reading no logit
(grammar.py has the torch path that the CPU runs, and that this must equal)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs

_BLOCK = 4096


@triton.jit(do_not_specialize=["words_stride", "rows_stride"])
def _bitmask_kernel(
    logits_ptr,
    logits_stride,
    rows_ptr,
    rows_stride,
    words_ptr,
    words_stride,
    vocab,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i * rows_stride).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    word = tl.load(words_ptr + i * words_stride + offs // 32, mask=ok, other=0)
    banned = ((word >> (offs % 32)) & 1) == 0
    ninf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_stride + offs, ninf, mask=ok & banned)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """logits[rows[i], j] = -inf where bit j % 32 of words[i, j // 32] is 0; rows int32
    [n] and words int32 [n, ceil(vocab / 32)], each of any row stride."""
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    _bitmask_kernel[(num_rows, triton.cdiv(vocab, _BLOCK))](
        logits,
        logits.stride(0),
        rows,
        rows.stride(0),
        words,
        words.stride(0),
        vocab,
        BLOCK=_BLOCK,
        num_warps=8,
        **launch_options(logits.device),
    )
