"""The Triton path's step inputs: persistent device buffers, filled by one host-to-device
copy from a pinned host buffer of the same layout.

The host buffer is int32 and holds, at fixed offsets, every per-step array the model and
the kernels read: input ids, positions, the slot mapping, the token feed, the rows that
sample and their count, sequence lengths, query starts and the block tables (last, so
that a step copies only the rows it uses). The device buffer never moves, so a CUDA graph
captured over its views replays any later step written into it.

The token feed: the previous step's sampled ids stay on the device (`sampled`), and a
token whose id is one of them (a decode right after its sample) reads it there, so a
step never waits for the previous step's ids to reach the host. They stay there until a
step that samples replaces them: a graph's argmax writes the rows below the step's
sample count only (`sample_count`), so a step that samples nothing keeps them for the
next one's feed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.attention.triton_metadata import TritonAttentionMetadata, decode_splits, tile_size
from zmqworker.model_runner.step_inputs import HostStep, StepGather


@dataclass(frozen=True)
class TokenFeed:
    """The previous step's samples still valid for this step: the batch row and token
    position each fills, and where it is in DeviceInputs.sampled."""

    rows: np.ndarray  # int64 [n]
    positions: np.ndarray  # [n]
    index: np.ndarray  # [n]


@dataclass
class DeviceStep:
    """One step's inputs on the device (views of DeviceInputs' buffers)."""

    metadata: TritonAttentionMetadata
    input_ids: torch.Tensor  # int32 [num_tokens]
    feed_index: torch.Tensor  # int32 [num_tokens]: index into sampled, or -1
    sample_index: torch.Tensor | None  # int32 [num_samples]; None: every token samples


class DeviceInputs:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        num_kv_heads: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        tokens, reqs = max_num_tokens, max_num_reqs
        self.max_num_reqs = reqs
        self.width = max_blocks_per_req
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.max_model_len = max_model_len
        self.tile = tile_size(block_size)
        # One request row more than a step has: a token graph's padding request.
        rows = reqs + 1
        sizes = {
            "input_ids": tokens,
            "positions": tokens,
            "slot_mapping": tokens,
            "feed_index": tokens,
            "sample_index": reqs,
            "sample_count": 1,
            "seq_lens": rows,
            "query_start_loc": rows + 1,
            "block_tables": rows * max_blocks_per_req,
        }
        self._offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self._offsets[name] = total
            total += size
        pinned = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=pinned)
        self._device = torch.zeros(total, dtype=torch.int32, device=device)
        host = self._host.numpy()
        self._host_views = {n: host[o : o + sizes[n]] for n, o in self._offsets.items()}
        self._device_views = {n: self._device[o : o + sizes[n]] for n, o in self._offsets.items()}
        self._gather = StepGather(
            self._host_views["input_ids"],
            self._host_views["positions"],
            self._host_views["slot_mapping"],
            self._host_views["query_start_loc"][: reqs + 1],
            self._host_views["seq_lens"][:reqs],
            block_size,
        )
        self._host_tables = self._host_views["block_tables"].reshape(rows, max_blocks_per_req)
        self.block_tables = self._device_views["block_tables"].view(rows, max_blocks_per_req)
        # The previous sampling step's ids, read by the token feed; a fixed address.
        self.sampled = torch.zeros(reqs, dtype=torch.int32, device=device)
        # How many of them this step's sample replaces (int32 [1]): a graph's argmax
        # writes no more (a step that samples nothing must keep them for the feed).
        self.sample_count = self._device_views["sample_count"]
        # Recorded after each upload: the host buffer is rewritten only once it has fired.
        self._uploaded = torch.cuda.Event() if pinned else None
        self._stream = torch.cuda.current_stream(device) if pinned else None
        self._feed_slot = np.full(reqs, -1, np.int64)
        self._feed_pos = np.zeros(reqs, np.int64)

    def write(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        num_tokens: int,
        feed: TokenFeed | None,
        sample_index: np.ndarray | None,
        pad_to: int | None = None,
        pad_tokens: tuple[int, int] | None = None,
    ) -> None:
        """Gather a step into the host buffer and upload it; views() then gives the device
        tensors (a graph replay needs none). sample_index: the token positions whose
        logits are sampled (None: all). pad_to: a decode step's graph size; rows past
        the step's requests attend nothing and write no KV. pad_tokens: a token graph's
        (tokens, request slots); padding tokens attend nothing and write no KV, and the
        sample index is padded with token 0 to as many rows as the graph samples. The
        sample count (sample_index's length, or num_tokens) bounds a graph's greedy ids."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's copy has read the buffer
        step = self._gather.gather(
            token_ids, block_table, rows, num_computed, num_scheduled, num_tokens
        )
        num_reqs = len(rows)
        self._host_tables[:num_reqs, : step.used_blocks] = block_table[rows, : step.used_blocks]
        feed_index = self._host_views["feed_index"]
        feed_index[:num_tokens] = -1
        if feed is not None:
            self._mark_feed(feed, step, feed_index[:num_tokens])
        if sample_index is not None:
            self._host_views["sample_index"][: len(sample_index)] = sample_index
        count = num_tokens if sample_index is None else len(sample_index)
        self._host_views["sample_count"][0] = count
        size = num_reqs
        if pad_to is not None:
            if num_tokens != num_reqs or pad_to < num_reqs:
                raise ValueError(f"only a decode step of at most {pad_to} requests pads to it")
            self._pad(num_reqs, pad_to)
            size = pad_to
        if pad_tokens is not None:
            graph_tokens, graph_reqs = pad_tokens
            padding = graph_tokens - num_tokens
            # Padding tokens need a request slot of their own.
            fits = padding >= 0 and num_reqs + (padding > 0) <= graph_reqs
            if sample_index is None or not fits:
                raise ValueError(
                    f"a step of {num_tokens} tokens and {num_reqs} requests (sample index "
                    f"given: {sample_index is not None}) does not pad to a token graph of "
                    f"{graph_tokens} tokens and {graph_reqs} requests"
                )
            self._pad_tokens(num_tokens, num_reqs, graph_tokens, graph_reqs)
            samples = self._host_views["sample_index"]
            samples[len(sample_index) : min(self.max_num_reqs, graph_tokens)] = 0
            size = graph_reqs
        self._upload(size)

    def sample_index(self, num_samples: int) -> torch.Tensor:
        """The device view of the sample index that write() uploaded."""
        return self._device_views["sample_index"][:num_samples]

    def views(
        self, num_tokens: int, num_reqs: int, max_query_len: int, num_samples: int | None
    ) -> DeviceStep:
        """The device views of a step of these sizes (what a CUDA graph captures)."""
        decode_only = max_query_len == 1
        device = self._device_views
        metadata = TritonAttentionMetadata(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            decode_only=decode_only,
            num_splits=self.splits(num_reqs) if decode_only else 1,
            slot_mapping=device["slot_mapping"][:num_tokens],
            positions=device["positions"][:num_tokens],
            query_start_loc=device["query_start_loc"][: num_reqs + 1],
            seq_lens=device["seq_lens"][:num_reqs],
            block_tables=self.block_tables[:num_reqs],
        )
        return DeviceStep(
            metadata=metadata,
            input_ids=device["input_ids"][:num_tokens],
            feed_index=device["feed_index"][:num_tokens],
            sample_index=None if num_samples is None else self.sample_index(num_samples),
        )

    def idle_decode(self, size: int) -> None:
        """Upload a decode step of `size` padding rows (attending nothing, writing no
        KV nor greedy ids): the contents a graph is warmed up and captured over."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._pad(0, size)
        self._host_views["query_start_loc"][0] = 0
        self._host_views["sample_count"][0] = 0
        self._upload(size)

    def idle_tokens(self, num_tokens: int, num_reqs: int) -> None:
        """Upload a step of num_tokens padding tokens over num_reqs request slots (none
        attending, none writing KV nor greedy ids, the logits of token 0): what a token
        graph is warmed up and captured over."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._pad_tokens(0, 0, num_tokens, num_reqs)
        self._host_views["query_start_loc"][0] = 0
        self._host_views["sample_index"][: min(self.max_num_reqs, num_tokens)] = 0
        self._host_views["sample_count"][0] = 0
        self._upload(num_reqs)

    def splits(self, num_reqs: int) -> int:
        """Decode splits at this batch size: a function of the size alone, so a graph
        captured at a size keeps being right."""
        return decode_splits(num_reqs, self.num_kv_heads, self.max_model_len, self.tile)

    def _mark_feed(self, feed: TokenFeed, step: HostStep, feed_index: np.ndarray) -> None:
        """feed_index[t] = the sample's index for tokens at a fed (row, position)."""
        self._feed_slot[feed.rows] = feed.index
        self._feed_pos[feed.rows] = feed.positions
        slot = self._feed_slot[step.token_rows]
        hit = (slot >= 0) & (self._feed_pos[step.token_rows] == step.positions)
        feed_index[hit] = slot[hit]
        self._feed_slot[feed.rows] = -1

    def _pad(self, start: int, end: int) -> None:
        views = self._host_views
        for name in ("input_ids", "positions", "seq_lens"):
            views[name][start:end] = 0
        views["slot_mapping"][start:end] = -1
        views["feed_index"][start:end] = -1
        views["query_start_loc"][start + 1 : end + 1] = np.arange(start + 1, end + 1)

    def _pad_tokens(self, num_tokens: int, num_reqs: int, size: int, size_reqs: int) -> None:
        """Tokens [num_tokens, size) to request num_reqs, of no history (its attention
        reads nothing), and requests past it empty; none of them writes KV."""
        views = self._host_views
        for name in ("input_ids", "positions"):
            views[name][num_tokens:size] = 0
        views["slot_mapping"][num_tokens:size] = -1
        views["feed_index"][num_tokens:size] = -1
        views["query_start_loc"][num_reqs + 1 : size_reqs + 1] = size
        views["seq_lens"][num_reqs:size_reqs] = 0

    def _upload(self, num_reqs: int) -> None:
        end = self._offsets["block_tables"] + num_reqs * self.width
        self._device[:end].copy_(self._host[:end], non_blocking=self._uploaded is not None)
        if self._uploaded is not None:
            self._uploaded.record(self._stream)
