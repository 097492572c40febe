"""One step's flat model inputs, gathered from per-row arrays with vectorised numpy.

Token t of the step belongs to request r = the one whose query range holds t, and sits at
position num_computed[r] + (t - query_start[r]); its input id and KV slot are read from
row r of the token and block tables at that position. Outputs land in buffers allocated
once for the largest step, so a step allocates only small temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.attention.metadata import AttentionMetadata, build_attention_metadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [num_tokens], on the device
    positions: torch.Tensor  # int64 [num_tokens], on the device
    attn_metadata: AttentionMetadata
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    seq_lens: np.ndarray  # int32 [num_reqs]: tokens in the KV cache after the step


class StepInputBuilder:
    """Builds StepInputs for steps of at most max_num_tokens tokens and max_num_reqs requests."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, block_size: int, device: torch.device
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.device = device
        self._arange = np.arange(max_num_tokens, dtype=np.int64)
        self._input_ids = np.zeros(max_num_tokens, np.int64)
        self._positions = np.zeros(max_num_tokens, np.int64)
        self._slots = np.zeros(max_num_tokens, np.int64)
        self._query_start = np.zeros(max_num_reqs + 1, np.int32)
        self._seq_lens = np.zeros(max_num_reqs, np.int32)

    def build(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        num_tokens: int,
    ) -> StepInputs:
        """token_ids [rows, width] and block_table [rows, max_blocks] are the per-row
        tables; rows, num_computed, num_scheduled describe the step's requests in order."""
        num_reqs = len(rows)
        if not 0 < num_reqs <= self.max_num_reqs or not 0 < num_tokens <= self.max_num_tokens:
            raise ValueError(
                f"a step of {num_reqs} requests and {num_tokens} tokens does not fit the "
                f"runner's {self.max_num_reqs} requests and {self.max_num_tokens} tokens"
            )
        query_start = self._query_start[: num_reqs + 1]
        np.cumsum(num_scheduled, out=query_start[1:])
        seq_lens = np.add(num_computed, num_scheduled, out=self._seq_lens[:num_reqs])
        positions = self._positions[:num_tokens]
        if num_tokens == num_reqs:  # decode only: one token per request, at num_computed
            token_rows = rows
            positions[:] = num_computed
        else:
            token_rows = np.repeat(rows, num_scheduled)
            np.add(
                np.repeat(num_computed - query_start[:-1], num_scheduled),
                self._arange[:num_tokens],
                out=positions,
            )
        input_ids = self._input_ids[:num_tokens]
        input_ids[:] = token_ids.ravel()[token_rows * token_ids.shape[1] + positions]
        bs = self.block_size
        block_ids = block_table.ravel()[token_rows * block_table.shape[1] + positions // bs]
        slots = self._slots[:num_tokens]
        np.add(block_ids * bs, positions % bs, out=slots)
        used_blocks = -(-int(seq_lens.max()) // bs)
        tables = block_table[rows, :used_blocks]
        metadata = build_attention_metadata(num_scheduled, seq_lens, tables, slots, bs, self.device)
        return StepInputs(
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=metadata,
            query_start_loc=query_start,
            seq_lens=seq_lens,
        )
