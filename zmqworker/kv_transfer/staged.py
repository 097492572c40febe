"""A prefill rank's staged KV (server.py's, one per request): the blocks that hold it in
the live cache, and the bytes a pull takes when it cannot read them in place: gathered
into a sealed memfd of the pool (on the server's thread, after the step that computed
them), whole for a pull through the memfd, the part asked for a pull over tcp (its heads,
blocks and layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import KVLayout, KVPull
from zmqworker.kv_transfer.blocks import gather, staged_nbytes, view_staged
from zmqworker.kv_transfer.staging import Memfd, MemfdPool


@dataclass
class Staged:
    """One request's KV in block_ids of the live cache (complete once ready, on a GPU,
    has passed), and once a pull needed bytes, at the start of a memfd too; until pulled
    or expired."""

    req_id: str
    block_ids: np.ndarray  # int64
    deadline: float
    ready: torch.cuda.Event | None = None
    memfd: Memfd | None = None
    readers: int = 1  # decode ranks that pull it (the pulls say)
    done: int = 0  # of them that said KVDone (or only released it)
    lent: bool = False  # a puller was answered with the blocks in place
    withdrawn: bool = False  # the engine gave up on it: no pull is answered

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def hold(self, seconds: float) -> None:
        """Keep it at least seconds from now: a puller was answered and reads it after."""
        self.deadline = max(self.deadline, time.monotonic() + seconds)


class StagedBytes:
    def __init__(self, layout: KVLayout, kv_caches: Callable[[], list[torch.Tensor]]) -> None:
        self.layout = layout
        self._kv_caches = kv_caches
        device = kv_caches()[0].device
        self._device = device if device.type == "cuda" else None
        self.pool = MemfdPool(self._device)  # page-locked for the GPU where there is one
        # The gathers wait on their prefill's step from a stream of their own.
        self._stream = torch.cuda.Stream(device) if self._device else None
        self._head_bytes = layout.block_size * layout.head_size * DTYPE_BYTES[layout.dtype]

    def nbytes(self, staged: Staged) -> int:
        """The bytes staged's KV takes in its memfd."""
        return staged_nbytes(self.layout, staged.num_blocks)

    def memfd(self, staged: Staged) -> Memfd:
        """staged's KV in a memfd: gathered out of the cache on the first call."""
        if staged.memfd is not None:
            return staged.memfd
        memfd = self.pool.take(self.nbytes(staged))
        try:
            view = view_staged(memoryview(memfd.memory), self.layout, staged.num_blocks)
            ids = torch.from_numpy(staged.block_ids)
            if self._stream is None:
                gather(self._kv_caches(), ids, view)
            else:
                assert staged.ready is not None
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(staged.ready)
                    gather(self._kv_caches(), ids, view)
            del view
        except BaseException:
            self.pool.give_back(memfd)
            raise
        staged.memfd = memfd
        return memfd

    def for_tcp(self, staged: Staged, pull: KVPull) -> memoryview:
        """The staged bytes pull takes: its heads (None: all) of its layers (None: all)
        of the blocks from first_block on. All blocks and heads of a run of layers go as
        they lie, without a copy; a part of them as one contiguous copy of that part
        (skipped blocks cut every layer's run)."""
        assert staged.memfd is not None
        layers = pull.layers or (0, self.layout.num_layers)
        layer_bytes = self.nbytes(staged) // self.layout.num_layers
        run = slice(layers[0] * layer_bytes, sum(layers) * layer_bytes)
        chosen = memoryview(staged.memfd.memory)[run]
        heads = pull.heads or (0, self.layout.num_kv_heads)
        if pull.first_block == 0 and heads == (0, self.layout.num_kv_heads):
            return chosen
        rows = np.frombuffer(chosen, np.uint8).reshape(
            layers[1] * 2, staged.num_blocks, self.layout.num_kv_heads, self._head_bytes
        )
        part = rows[:, pull.first_block :, heads[0] : sum(heads)]
        return memoryview(np.ascontiguousarray(part).reshape(-1))

    def close(self) -> None:
        self.pool.close()
