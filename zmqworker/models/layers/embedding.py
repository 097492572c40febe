"""Vocab-parallel embedding and LM head: each TP rank holds a contiguous range of the
(padded) vocabulary."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import ParallelState, tp_all_gather, tp_all_reduce
from zmqworker.models.layers.linear import linear
from zmqworker.models.layers.weights import TensorSlice


class VocabShard(nn.Module):
    """Rows [vocab_start, vocab_start + rows_per_rank) of a [vocab, hidden] table; rows past
    the real vocabulary are zero padding."""

    def __init__(self, vocab_size: int, hidden_size: int, source: str, state: ParallelState):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.source = source
        self.state = state
        self.rows_per_rank = cdiv(vocab_size, state.tp_size)
        self.vocab_start = state.tp_rank * self.rows_per_rank
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(
            torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False
        )

    def tensor_slices(self) -> dict[str, list[TensorSlice]]:
        if self.num_real_rows == 0:
            return {"weight": []}
        full = (self.vocab_size, self.hidden_size)
        return {
            "weight": [TensorSlice(self.source, full, 0, self.vocab_start, self.num_real_rows, 0)]
        }


class VocabParallelEmbedding(VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_group is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        embedded = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        # masked_fill, not a multiply: a padding row may hold anything (e.g. after wake-up).
        embedded.masked_fill_(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(embedded, self.state)


class ParallelLMHead(VocabShard):
    """Logits over the full vocabulary on every TP rank. When tied to an embedding of the
    same rank it shares that parameter and loads nothing itself. tied_name: the head's own
    checkpoint name when it takes the embedding's tensor (source) instead."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        source: str,
        state: ParallelState,
        tied_name: str | None = None,
    ):
        super().__init__(vocab_size, hidden_size, source, state)
        self.shares_embedding = False
        self.tied_name = tied_name

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.shares_embedding = True

    def tensor_slices(self) -> dict[str, list[TensorSlice]]:
        if self.shares_embedding:
            return {}
        return super().tensor_slices()

    def tied_copies(self) -> list[tuple[torch.Tensor, TensorSlice, TensorSlice]]:
        """(weight, this rank's rows of the head's own tensor, the same rows of the
        embedding's) when tied: a checkpoint may hold the head too, and transformers
        unties the two when it differs from the embedding."""
        if self.tied_name is None:
            return []
        rows = VocabShard.tensor_slices(self)["weight"]
        return [(self.weight, dataclasses.replace(s, name=self.tied_name), s) for s in rows]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight)
        if self.state.tp_group is not None:
            logits = tp_all_gather(logits, self.state, dim=-1)
        return logits[..., : self.vocab_size].float()
