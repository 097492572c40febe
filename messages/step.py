"""The per-step messages, with vLLM v1's field semantics, laid out in columns for speed.

A request is named on the hot path by its handle: a non-negative int32 the engine
assigns when it first sends the request (NewRequestData carries both the handle and the
string req_id), valid until the request finishes or is preempted. Per-request numbers
are numpy columns, which the codec moves as raw bytes, so a 256-request decode step
costs a few memcpys rather than thousands of small msgpack objects. Ragged data (several
values per request) is a flat array plus a per-request count column.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from messages.sampling import SamplingParams, TokenId


class NewRequestData(msgspec.Struct, tag=True):
    """A request the worker has not seen (or that starts over after preemption), in full.

    prompt_token_ids holds every token to compute: for a request that restarts after
    preemption, the prompt followed by the tokens it had generated (num_output_tokens of
    them, which the penalties and min_tokens count as outputs). eos_token_ids are the ids
    min_tokens holds back besides stop_token_ids (unless ignore_eos).
    """

    req_id: str
    req_handle: int
    prompt_token_ids: np.ndarray  # int32 [prompt_len]
    sampling_params: SamplingParams
    block_ids: np.ndarray  # int32 [num_blocks]: the request's block table so far
    num_scheduled_tokens: int
    num_computed_tokens: int = 0  # tokens whose KV is already cached (prefix-cache hits)
    num_output_tokens: int = 0  # of prompt_token_ids, the last ones: generated before
    eos_token_ids: list[TokenId] = []  # the engine's end-of-sequence ids


# Rows of CachedRequestData.columns.
HANDLE, NUM_COMPUTED, NUM_SCHEDULED, NUM_NEW_BLOCKS, NUM_NEW_TOKENS, NUM_PLACEHOLDERS = range(6)
NUM_COLUMNS = 6


class CachedRequestData(msgspec.Struct, tag=True):
    """Requests the worker already holds, as deltas since the previous step.

    columns is one int32 array [6, n], a row per field, a column per request:
      HANDLE            the request's handle
      NUM_COMPUTED      tokens already in the KV cache before this step
      NUM_SCHEDULED     tokens to compute this step
      NUM_NEW_BLOCKS    how many of new_block_ids belong to this request (in order)
      NUM_NEW_TOKENS    how many of new_token_ids belong to this request (in order)
      NUM_PLACEHOLDERS  0 or 1: the last scheduled token is one the engine has not seen,
                        sampled by the worker's previous step (async scheduling)
    new_token_ids carries tokens the worker did not sample itself: those sampled on the
    last pipeline stage, for the other stages. A request in resumed_req_handles was
    preempted and comes back with its KV kept: its block table is replaced by its new
    blocks instead of extended.
    """

    columns: np.ndarray  # int32 [6, n]
    new_block_ids: np.ndarray | None = None  # int32 [sum of NUM_NEW_BLOCKS]; None if 0
    new_token_ids: np.ndarray | None = None  # int32 [sum of NUM_NEW_TOKENS]; None if 0
    resumed_req_handles: list[int] = []

    @classmethod
    def build(
        cls,
        req_handles: Sequence[int],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Sequence[int],
        new_block_ids: Sequence[Sequence[int]] | None = None,
        new_token_ids: Sequence[Sequence[int]] | None = None,
        resumed_req_handles: Sequence[int] = (),
        num_placeholders: Sequence[int] | None = None,
    ) -> CachedRequestData:
        """From per-request values; None for new blocks, tokens or placeholders means
        none for anyone."""
        n = len(req_handles)
        columns = np.zeros((NUM_COLUMNS, n), np.int32)
        columns[HANDLE] = req_handles
        columns[NUM_COMPUTED] = num_computed_tokens
        columns[NUM_SCHEDULED] = num_scheduled_tokens
        if num_placeholders is not None:
            columns[NUM_PLACEHOLDERS] = num_placeholders
        blocks, tokens = _ragged(new_block_ids, n), _ragged(new_token_ids, n)
        columns[NUM_NEW_BLOCKS], columns[NUM_NEW_TOKENS] = blocks[0], tokens[0]
        return cls(columns, blocks[1], tokens[1], list(resumed_req_handles))

    @classmethod
    def empty(cls) -> CachedRequestData:
        return cls.build([], [], [])

    def __len__(self) -> int:
        return self.columns.shape[1]

    @property
    def req_handles(self) -> np.ndarray:
        return self.columns[HANDLE]

    @property
    def num_computed_tokens(self) -> np.ndarray:
        return self.columns[NUM_COMPUTED]

    @property
    def num_scheduled_tokens(self) -> np.ndarray:
        return self.columns[NUM_SCHEDULED]

    @property
    def num_new_blocks(self) -> np.ndarray:
        return self.columns[NUM_NEW_BLOCKS]

    @property
    def num_new_tokens(self) -> np.ndarray:
        return self.columns[NUM_NEW_TOKENS]

    @property
    def num_placeholders(self) -> np.ndarray:
        return self.columns[NUM_PLACEHOLDERS]


def _ragged(rows: Sequence[Sequence[int]] | None, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(counts, flat values or None when there are none) of n rows of ints; None stands
    for n empty rows."""
    if rows is None:
        return np.zeros(n, np.int32), None
    counts = np.fromiter((len(r) for r in rows), np.int32, count=n)
    total = int(counts.sum())
    if total == 0:
        return counts, None
    return counts, np.fromiter((v for r in rows for v in r), np.int32, count=total)


class SchedulerOutput(msgspec.Struct, tag=True):
    """One scheduler step. finished and preempted requests leave the batch before the
    step runs (a preempted request comes back later, as new or as resumed).
    kv_connector_metadata: the step's KV transfer orders (messages/kv_transfer.py);
    a step may carry only those, computing nothing."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    total_num_scheduled_tokens: int
    finished_req_handles: list[int] = []
    preempted_req_handles: list[int] = []
    kv_connector_metadata: KVConnectorMetadata | None = None


class GrammarOutput(msgspec.Struct, tag=True):
    """Structured-output constraints for one step: bit j of row i (word j // 32, bit
    j % 32) allows token j for req_handles[i]."""

    req_handles: np.ndarray  # int32 [n]
    grammar_bitmask: np.ndarray  # int32 [n, ceil(vocab / 32)]


class LogprobsLists(msgspec.Struct, tag=True):
    """Row i belongs to the i-th request of the output; column 0 is the sampled token,
    columns 1..k the top-k tokens."""

    logprob_token_ids: np.ndarray  # int32 [n, k + 1]
    logprobs: np.ndarray  # float32 [n, k + 1]
    sampled_token_ranks: np.ndarray  # int32 [n]


class PromptLogprobs(msgspec.Struct, tag=True):
    """The prompt logprobs a step computed, for the requests that asked for them: request
    req_handles[i] has num_rows[i] rows, one after the other, for its prompt positions
    first_positions[i] on (position p: prompt token p given those before it; position 0
    has none). Each row as LogprobsLists': column 0 the prompt token, then the top k, k
    the largest prompt_logprobs of the step's requests; the rank is the prompt token's."""

    req_handles: np.ndarray  # int32 [m]
    first_positions: np.ndarray  # int32 [m], each >= 1
    num_rows: np.ndarray  # int32 [m]
    rows: LogprobsLists  # [sum(num_rows), k + 1]


class ModelRunnerOutput(msgspec.Struct, tag=True):
    """What the last pipeline stage returns for a step. sampled_token_ids[i] is the token
    sampled for req_handles[i], or -1 when that request is in the middle of a chunked
    prefill and sampled nothing. kv_connector_output: the KV transfers that ended since
    the previous step's output (None: none, or no KV connector). prompt_logprobs: those
    of the prompt positions the step computed, for the requests that asked (None: none)."""

    req_handles: np.ndarray  # int32 [n]
    sampled_token_ids: np.ndarray  # int32 [n]
    logprobs: LogprobsLists | None = None
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs: PromptLogprobs | None = None


class IntermediateTensors(msgspec.Struct, tag=True):
    """What one pipeline stage hands the next: hidden states and residual, by name.

    The values are torch tensors, checked here rather than typed, so that importing the
    messages does not import torch (an engine has no use for it)."""

    tensors: dict[str, Any]

    def __post_init__(self) -> None:
        torch = sys.modules.get("torch")  # a tensor can only exist once torch is imported
        for name, value in self.tensors.items():
            if torch is None or not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"IntermediateTensors.tensors[{name!r}] must be a torch.Tensor, "
                    f"got {type(value).__name__}"
                )
