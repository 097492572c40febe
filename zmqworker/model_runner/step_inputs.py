"""One step's flat model inputs, gathered from per-row arrays with vectorised numpy.

Token t of the step belongs to request r = the one whose query range holds t, and sits at
position num_computed[r] + (t - query_start[r]); its input id and KV slot are read from
row r of the token and block tables at that position. Outputs land in buffers allocated
once for the largest step (StepGather), so a step allocates only small temporaries. The
plain-torch path turns them into tensors here (StepInputBuilder); the Triton path gathers
into pinned memory instead (device_inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.attention.decode import AttentionGeometry
from zmqworker.attention.metadata import AttentionMetadata, build_attention_metadata
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.cdiv import cdiv


@dataclass
class HostStep:
    """Views of a StepGather's buffers for one step."""

    token_rows: np.ndarray  # int64 [num_tokens]: the batch row of each token
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slot_mapping: np.ndarray  # [num_tokens]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]: tokens in the KV cache after the step
    used_blocks: int  # block table columns the step reads: those of its longest request


class StepGather:
    """Gathers steps of at most len(input_ids) tokens and len(seq_lens) requests into the
    given buffers (any integer dtypes; input_ids, positions, slot_mapping alike long)."""

    def __init__(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
    ) -> None:
        if not len(input_ids) == len(positions) == len(slot_mapping):
            raise ValueError("input_ids, positions and slot_mapping must be of one length")
        if len(query_start_loc) != len(seq_lens) + 1:
            raise ValueError("query_start_loc needs one entry more than seq_lens")
        self.max_num_tokens = len(input_ids)
        self.max_num_reqs = len(seq_lens)
        self.block_size = block_size
        self._input_ids = input_ids
        self._positions = positions
        self._slots = slot_mapping
        self._query_start = query_start_loc
        self._seq_lens = seq_lens
        self._arange = np.arange(self.max_num_tokens, dtype=np.int64)

    def gather(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        num_tokens: int,
    ) -> HostStep:
        """token_ids [rows, width] and block_table [rows, max_blocks] are the per-row
        tables; rows, num_computed, num_scheduled describe the step's requests in order."""
        num_reqs = len(rows)
        if not 0 < num_reqs <= self.max_num_reqs or not 0 < num_tokens <= self.max_num_tokens:
            raise ValueError(
                f"a step of {num_reqs} requests and {num_tokens} tokens does not fit the "
                f"runner's {self.max_num_reqs} requests and {self.max_num_tokens} tokens"
            )
        query_start = self._query_start[: num_reqs + 1]
        query_start[0] = 0
        np.cumsum(num_scheduled, out=query_start[1:])
        seq_lens = self._seq_lens[:num_reqs]
        seq_lens[:] = num_computed + num_scheduled
        if num_tokens == num_reqs:  # decode only: one token per request, at num_computed
            token_rows = np.asarray(rows, np.int64)
            positions = num_computed.astype(np.int64)
        else:
            token_rows = np.repeat(rows, num_scheduled)
            positions = (
                np.repeat(num_computed - query_start[:-1], num_scheduled)
                + self._arange[:num_tokens]
            )
        self._positions[:num_tokens] = positions
        self._input_ids[:num_tokens] = token_ids.ravel()[
            token_rows * token_ids.shape[1] + positions
        ]
        bs = self.block_size
        block_ids = block_table.ravel()[token_rows * block_table.shape[1] + positions // bs]
        self._slots[:num_tokens] = block_ids * bs + positions % bs
        return HostStep(
            token_rows=token_rows,
            input_ids=self._input_ids[:num_tokens],
            positions=self._positions[:num_tokens],
            slot_mapping=self._slots[:num_tokens],
            query_start_loc=query_start,
            seq_lens=seq_lens,
            used_blocks=cdiv(int(seq_lens.max()), bs),
        )


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [num_tokens], on the device
    positions: torch.Tensor  # int64 [num_tokens], on the device
    attn_metadata: AttentionMetadata
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    seq_lens: np.ndarray  # int32 [num_reqs]: tokens in the KV cache after the step


class StepInputBuilder:
    """Builds the plain-torch path's StepInputs for steps of at most max_num_tokens tokens
    and max_num_reqs requests, for layers of this attention geometry; the attention
    gathers histories into workspace."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        block_size: int,
        geometry: AttentionGeometry,
        workspace: GatherWorkspace,
        device: torch.device,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.geometry = geometry
        self.workspace = workspace
        self._gather = StepGather(
            np.zeros(max_num_tokens, np.int64),
            np.zeros(max_num_tokens, np.int64),
            np.zeros(max_num_tokens, np.int64),
            np.zeros(max_num_reqs + 1, np.int32),
            np.zeros(max_num_reqs, np.int32),
            block_size,
        )

    def build(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        num_tokens: int,
    ) -> StepInputs:
        step = self._gather.gather(
            token_ids, block_table, rows, num_computed, num_scheduled, num_tokens
        )
        tables = block_table[rows, : step.used_blocks]
        metadata = build_attention_metadata(
            num_scheduled,
            step.seq_lens,
            tables,
            step.slot_mapping,
            self.block_size,
            self.geometry,
            self.workspace,
            self.device,
        )
        return StepInputs(
            input_ids=torch.from_numpy(step.input_ids).to(self.device),
            positions=torch.from_numpy(step.positions).to(self.device),
            attn_metadata=metadata,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
        )
