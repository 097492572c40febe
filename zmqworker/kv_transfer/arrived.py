"""A piece of a load's KV that came from one prefill rank (or why it did not): what the
puller hands the worker's thread to copy into the load's blocks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from messages.kv_peer import KVLayout
from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer.head_map import HeadSource
from zmqworker.kv_transfer.peer_caches import PeerCache


@dataclass
class Arrived:
    """A piece of a load's KV from one source, ready to copy into its blocks (buffer:
    [layers, 2, n, heads, slots] bytes of layout, the load's blocks from first_block on,
    its layers the staged ones from first_layer on;
    or sources: the producer's cache, opened here (GPU) or mapped (host), the load's
    blocks at source_ids in it; the source's heads start at head first of it), or why
    it failed (error)."""

    load: KVLoad
    source: HeadSource
    buffer: Any = None  # a zmq frame's buffer or a view of a peer's memfd mapping
    keep: list[Any] = field(default_factory=list)  # what the buffer lives in
    error: str | None = None
    layout: KVLayout | None = None
    first: int = 0
    first_block: int = 0
    first_layer: int = 0
    unhold: Callable[[], None] | None = None  # lets the mapping the buffer is in go
    sources: PeerCache | None = None
    source_ids: np.ndarray | None = None  # int64
    received: float = field(default_factory=time.monotonic)
    hold_s: float = 0.0  # how long the producer holds sources' blocks from its answer

    def stale(self, timeout_s: float, at: float | None = None) -> str | None:
        """Why a copy out of the producer's cache must not start now (or have ended at
        at, a copy made ahead of the answer), or None: past half of the time the
        producer holds the blocks from its answer (hold_s, and this side's timeout_s
        where it said none or more)."""
        limit_s = min(timeout_s, self.hold_s or timeout_s) / 2
        age = (time.monotonic() if at is None else at) - self.received
        if self.sources is None or age <= limit_s:
            return None
        return f"the prefill's answer is {age:.1f} s old, past {limit_s:.1f} s: its blocks may go"

    def release(self) -> None:
        """Nothing reads the buffer any more (its copies are done)."""
        self.keep.clear()
        self.buffer = self.sources = None
        if self.unhold is not None:
            self.unhold, unhold = None, self.unhold
            unhold()
