"""The host KV tier, the worker's side (the engine's index is zmqworker/engine/host_tier.py):
num_slots blocks of this worker's KV in host memory, pinned on CUDA, made once with the
cache, and the copies each step orders between them and the cache's blocks.

A slot holds one block of every layer of this worker: [layers, 2, heads, block_size *
head_size] (keys then values, the cache's per-block layout), contiguous, so that a run of
consecutive slots is one copy either way. Each tp rank keeps its own heads, each pipeline
stage its own layers; the engine's slot numbers are the same on every worker.

A step's copies are done in before_step, before its forward, stores then loads
(KVHostCopies says why). On CUDA they are issued on the current stream, the forward's,
without waiting on the host: the stream runs them in order with the steps before and
after, so a store reads its block before the step's forward (or a load) overwrites it,
a load lands before the forward reads it, and a slot is never read and written out of
order. They do not overlap the forward (a side stream with events would let a store
overlap the previous step); correctness needs nothing more. On the CPU each block's
keys and values of each layer are one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from messages import KVCacheSpec
from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from zmqworker.kv_transfer import piece_copies
from zmqworker.kv_transfer.blocks import for_each_layer
from zmqworker.kv_transfer.connector import KVConnector
from zmqworker.models.registry import torch_dtype


class HostKVConnector(KVConnector):
    def __init__(
        self, num_slots: int, kv_caches: Callable[[], list[torch.Tensor]], spec: KVCacheSpec
    ) -> None:
        """kv_caches: the rank's cache tensors now (sleep and wake_up make new ones)."""
        caches = kv_caches()
        if not caches:
            raise ValueError("the host KV tier needs the KV cache: make it after the cache")
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.kv_caches = kv_caches
        self.num_slots = num_slots
        # A cache in host memory: a copy per block row; else gathers on the device and
        # one copy per run of consecutive slots (which also work on host tensors).
        self.row_copies = caches[0].device.type == "cpu"
        _, _, heads, row = caches[0].shape
        device = caches[0].device
        shape = (num_slots, len(caches), 2, heads, row)
        try:
            self.buffer: torch.Tensor | None = torch.empty(
                shape, dtype=torch_dtype(spec.dtype), pin_memory=device.type == "cuda"
            )
        except RuntimeError as exc:
            nbytes = np.prod(shape) * caches[0].element_size()
            raise ValueError(
                f"the host KV tier of {num_slots} blocks ({nbytes} bytes of host memory"
                f"{', pinned' if device.type == 'cuda' else ''}) could not be allocated: "
                f"{exc}; give kv_offloading_size less"
            ) from exc

    @property
    def served(self) -> frozenset[str]:
        return frozenset({"host"})

    def cancel(self, metadata: KVConnectorMetadata) -> None:
        """Nothing to cancel: a step's copies end within it."""

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        copies = metadata.host if metadata is not None else None
        if copies is None:
            return
        if self.buffer is None:
            raise RuntimeError("host KV copies ordered after the host tier shut down")
        caches = self.kv_caches()
        bounds = (caches[0].shape[1], self.num_slots)
        stores = _pairs(copies.store_blocks, copies.store_slots, "store", *bounds)
        loads = _pairs(copies.load_blocks, copies.load_slots, "load", *bounds)
        if stores is not None:
            self._store(caches, *stores)
        if loads is not None:
            self._load(caches, *loads)

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Nothing: every copy is done before the forward."""

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        """None: the copies end within their step, so there is never anything to report."""
        return None

    def shutdown(self) -> None:
        self.buffer = None

    # helpers ------------------------------------------------------------------------

    def _store(self, caches: list[torch.Tensor], blocks: np.ndarray, slots: np.ndarray) -> None:
        """Blocks of every layer into slots: on CUDA gathered on the device, then one copy
        per run of consecutive slots; on the CPU a row copy each."""
        assert self.buffer is not None
        if self.row_copies:
            _copy_rows(caches, self.buffer, blocks, slots, store=True)
            return
        ids = torch.from_numpy(blocks).to(caches[0].device)
        # [layers, 2, n, heads, row] -> [n, layers, 2, heads, row], contiguous.
        staged = torch.stack([cache.index_select(1, ids) for cache in caches])
        staged = staged.permute(2, 0, 1, 3, 4).contiguous()
        for start, stop, slot in _runs(slots):
            self.buffer[slot : slot + stop - start].copy_(staged[start:stop], non_blocking=True)

    def _load(self, caches: list[torch.Tensor], blocks: np.ndarray, slots: np.ndarray) -> None:
        """Slots into blocks of every layer: one copy per run of consecutive slots into a
        staging tensor on the device, then one indexed copy per layer (on CUDA; on the CPU
        a row copy each)."""
        assert self.buffer is not None
        if self.row_copies:
            _copy_rows(caches, self.buffer, blocks, slots, store=False)
            return
        device = caches[0].device
        staged = torch.empty((len(slots), *self.buffer.shape[1:]), dtype=self.buffer.dtype,
                             device=device)  # fmt: skip
        for start, stop, slot in _runs(slots):
            staged[start:stop].copy_(self.buffer[slot : slot + stop - start], non_blocking=True)
        ids = torch.from_numpy(blocks).to(device)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, ids, staged[:, layer].transpose(0, 1))


def _pairs(
    blocks: np.ndarray, slots: np.ndarray, what: str, num_blocks: int, num_slots: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(blocks, slots) as int64, checked against the cache and the tier; None if empty.
    Raises ValueError naming what is wrong (the order came over a socket)."""
    if blocks.ndim != 1 or slots.ndim != 1 or len(blocks) != len(slots):
        raise ValueError(
            f"host KV {what}: {blocks.shape} block ids against {slots.shape} slots "
            "(one-dimensional arrays of one length expected)"
        )
    if not len(blocks):
        return None
    for name, values, bound in (("block", blocks, num_blocks), ("slot", slots, num_slots)):
        if values.dtype.kind not in "iu":
            raise ValueError(f"host KV {what}: {name} ids of dtype {values.dtype}, not integers")
        if values.min() < 0 or values.max() >= bound:
            raise ValueError(f"host KV {what}: a {name} id outside [0, {bound})")
    if len(np.unique(blocks)) != len(blocks) or len(np.unique(slots)) != len(slots):
        raise ValueError(f"host KV {what}: a block or a slot named twice")
    return blocks.astype(np.int64), slots.astype(np.int64)


def _copy_rows(
    caches: list[torch.Tensor], buffer: torch.Tensor, blocks: np.ndarray, slots: np.ndarray,
    store: bool,
) -> None:  # fmt: skip
    """Host caches' blocks into the tier's slots (store) or back (load), each block's keys
    and values of each layer one piece of their row (piece_copies.py): copied once, where
    numpy's indexed copy of indexed rows gathers them into a buffer of its own first."""
    row = caches[0][0, 0].nbytes  # a block's keys (or values) in one layer
    half, slot = caches[0][0].nbytes, buffer[0].nbytes
    at_cache = np.r_[blocks * row, blocks * row + half].astype(np.int64)
    at_tier = np.r_[slots * slot, slots * slot + row].astype(np.int64)
    lengths = np.full(len(at_cache), row, dtype=np.int64)

    def copy(layer: int) -> None:
        tier = at_tier + layer * 2 * row
        if store:
            piece_copies.copy_pieces(buffer, caches[layer], tier, at_cache, lengths)
        else:
            piece_copies.copy_pieces(caches[layer], buffer, at_cache, tier, lengths)

    # Slices hold the GIL: threads would only take turns at them.
    for_each_layer(copy, len(caches), parallel=piece_copies.in_kernel())


def _runs(slots: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(start, stop, first slot) of each run of consecutive slots in slots."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    bounds = [0, *breaks.tolist(), len(slots)]
    for start, stop in zip(bounds, bounds[1:], strict=False):
        yield start, stop, int(slots[start])
