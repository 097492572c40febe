"""Penalties and biases on a step's logits, before temperature and the filters: vLLM's
SamplingParams semantics, in its order.

0. every token outside allowed_token_ids to -inf (-inf stays -inf through the rest);
1. banned tokens to -inf: the bad words whose other tokens end the output, and EOS and
   the stop token ids while the output is shorter than min_tokens;
2. logit_bias added;
3. the repetition penalty on the tokens of the prompt or the output: a positive logit
   divided by it, a negative one multiplied (transformers' RepetitionPenaltyLogitsProcessor);
4. logit - frequency * count, then - presence * (count > 0), over the output's counts.

Everything here is on the device and vectorised over only the rows that use it; the
CUDA step runs the Triton kernels of penalty_kernels.py (and grammar_kernel.py's bitmask
for allowed_token_ids), the CPU the torch ops below, which give the same values. After
the step samples, count_outputs adds each penalised request's token to its output
counts, on the device, so the next step (under async scheduling already queued behind
this one) reads them without a host round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Entries:
    """Sparse edits by batch row: logits row index_of_row[rows[e]] (when >= 0), token
    tokens[e], plus values[e] (None: -inf, a ban). int32 but values float32 [E]."""

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor | None


@dataclass(frozen=True)
class Dense:
    """The rows of logits that take a repetition, frequency or presence penalty."""

    index: torch.Tensor  # int32 [p]: rows of the step's logits
    rows: torch.Tensor  # int32 [p]: their batch rows (of counts and prompt_bits)
    penalties: torch.Tensor  # float32 [3, p]: repetition, frequency, presence
    repetition: bool  # some repetition penalty is not 1 (its pass reads the prompt bits)


@dataclass(frozen=True)
class Mask:
    """The rows of logits that allow only some tokens (allowed_token_ids)."""

    index: torch.Tensor  # int32 [m]: rows of the step's logits
    words: torch.Tensor  # int32 [m, ceil(vocab / 32)]: bit j set where token j is allowed


@dataclass(frozen=True)
class PenaltyStep:
    """What one step's sampling applies, on the device; None parts are not used by any
    request that samples this step."""

    counts: torch.Tensor  # int32 [max_num_seqs, vocab]: each batch row's output counts
    prompt_bits: torch.Tensor  # int32 [max_num_seqs, ceil(vocab / 32)]: prompt tokens
    index_of_row: torch.Tensor | None  # int32 [max_num_seqs]: logits row, -1 if none
    bans: Entries | None
    bias: Entries | None
    dense: Dense | None
    allowed: Mask | None = None


def apply_penalties(logits: torch.Tensor, step: PenaltyStep, fused: bool) -> None:
    """Apply step to logits (float32 [n, vocab], modified in place); fused: the Triton
    kernels, else torch ops (a CPU install may have no Triton)."""
    add, apply, mask = _add_entries, _apply_dense, _apply_mask
    if fused:
        from zmqworker.model_runner.grammar_kernel import apply_bitmask
        from zmqworker.model_runner.penalty_kernels import add_entries, apply_dense

        add, apply, mask = add_entries, apply_dense, apply_bitmask
    if step.allowed is not None:
        mask(logits, step.allowed.index, step.allowed.words)
    for entries in (step.bans, step.bias):
        if entries is not None:
            assert step.index_of_row is not None
            add(logits, step.index_of_row, entries.rows, entries.tokens, entries.values)
    dense = step.dense
    if dense is not None:
        apply(
            logits,
            step.counts,
            step.prompt_bits,
            dense.index,
            dense.rows,
            dense.penalties,
            dense.repetition,
        )


def count_outputs(step: PenaltyStep, sampled: torch.Tensor, fused: bool) -> None:
    """Count each penalised request's sampled token (sampled: int32 [n], by logits row)."""
    dense = step.dense
    if dense is None:
        return
    count = _count_outputs
    if fused:
        from zmqworker.model_runner.penalty_kernels import count_outputs as count
    count(step.counts, sampled, dense.index, dense.rows)


# the torch twins of the kernels -------------------------------------------------------


def _add_entries(
    logits: torch.Tensor,
    index_of_row: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    values: torch.Tensor | None,
) -> None:
    at = index_of_row.index_select(0, rows)
    valid = at >= 0
    if values is None:
        values = torch.full(tokens.shape, -torch.inf, device=logits.device)
    # Entries of rows that do not sample add 0 to logits[0, 0]: no mask, no host sync.
    index = (torch.where(valid, at, 0).long(), torch.where(valid, tokens, 0).long())
    logits.index_put_(index, torch.where(valid, values, 0.0), accumulate=True)


def _apply_mask(logits: torch.Tensor, index: torch.Tensor, words: torch.Tensor) -> None:
    banned = unpack_bits(words, logits.shape[1]).logical_not_()
    index = index.long()
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, -torch.inf))


def _apply_dense(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_bits: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    penalties: torch.Tensor,
    repetition: bool,
) -> None:
    index, rows = index.long(), rows.long()
    values = logits.index_select(0, index)
    row_counts = counts.index_select(0, rows)
    in_output = row_counts > 0
    factor, frequency, presence = (p.unsqueeze(1) for p in penalties)
    if repetition:  # else every factor is 1: the pass would change nothing
        seen = unpack_bits(prompt_bits.index_select(0, rows), logits.shape[1]).logical_or_(
            in_output
        )
        penalized = torch.where(values > 0, values / factor, values * factor)
        values = torch.where(seen, penalized, values)
    values.sub_(frequency * row_counts)
    values.sub_(presence * in_output)
    logits.index_copy_(0, index, values)


def _count_outputs(
    counts: torch.Tensor, sampled: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
) -> None:
    tokens = sampled.index_select(0, index.long()).long()
    ones = torch.ones(tokens.shape, dtype=counts.dtype, device=counts.device)
    counts.index_put_((rows.long(), tokens), ones, accumulate=True)


def unpack_bits(words: torch.Tensor, size: int) -> torch.Tensor:
    """bool [n, size] from int32 [n, ceil(size / 32)] words: bit j of word i is j + 32 i."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :size].bool()
