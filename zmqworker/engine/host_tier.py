"""The host KV tier, the engine's side (the worker's is zmqworker/kv_transfer/host_tier.py):
which prefix-cache blocks have their KV in which slot of the workers' host memory, least
recently used first, and the copies the step being built orders.

A full block that leaves the device's prefix cache (KVBlockManager takes its block for
other tokens) is stored into a slot, unless its hash is there already; when every slot
is taken, the least recently used entry gives up its slot. A waiting request whose
prefix misses the device cache goes on into the tier: the blocks found there are loaded
into fresh device blocks and count as computed (prefix-cache hits). The workers do a
step's copies before its forward, stores first: a store reads its block before anything
of the step writes it (a load of the same step included), and a load lands before the
forward reads it. A slot the step being built reads or writes is not taken again in
that step (its store or load would see the other's bytes); when every slot is such, the
evicted block is dropped, and recomputed if asked for again. Nothing waits on the tier:
a miss, a dropped store or a full tier only means computing the tokens again.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from messages import KVCacheSpec, KVHostCopies

logger = logging.getLogger(__name__)


class HostKVTier:
    """The index of num_slots host slots. Not thread-safe: the block manager drives it."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._busy: set[int] = set()  # slots the step being built stores into or loads from
        self._stores: list[tuple[int, int]] = []  # (device block, slot)
        self._loads: list[tuple[int, int]] = []  # (slot, device block)
        # Since start, in blocks: stored, loaded back, and evicted blocks dropped unstored.
        self.num_stored = 0
        self.num_loaded = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def new_step(self) -> None:
        """Start building a new step: the slots of the last one may be taken again (the
        workers do each step's copies in order)."""
        self._busy.clear()

    def evicted(self, block: int, block_hash: bytes) -> None:
        """block, cached under block_hash, is about to hold other tokens: keep its KV."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._slot_of[block_hash] = slot
        self._busy.add(slot)
        self._stores.append((block, slot))
        self.num_stored += 1

    def find(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the leading hashes the tier holds (none past the first miss),
        made the most recently used and kept from reuse in the step being built. A slot
        the step loads already (into another request's block, which is no prefix-cache
        hit before the next step) counts as a miss: a step loads each slot once."""
        loading = {slot for slot, _ in self._loads}
        slots = []
        for block_hash in hashes:
            slot = self._slot_of.get(block_hash)
            if slot is None or slot in loading:
                break
            self._slot_of.move_to_end(block_hash)
            self._busy.add(slot)
            slots.append(slot)
        return slots

    def load(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Order slots (from find, in this step) copied into device blocks."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} host slots to load into {len(blocks)} blocks")
        self._loads.extend(zip(slots, blocks, strict=True))
        self.num_loaded += len(slots)

    def take_copies(self) -> KVHostCopies | None:
        """The copies the step being built orders (None: none), handed over once."""
        if not (self._stores or self._loads):
            return None
        stores = np.array(self._stores, np.int32).reshape(-1, 2)
        loads = np.array(self._loads, np.int32).reshape(-1, 2)
        self._stores, self._loads = [], []
        return KVHostCopies(
            store_blocks=np.ascontiguousarray(stores[:, 0]),
            store_slots=np.ascontiguousarray(stores[:, 1]),
            load_slots=np.ascontiguousarray(loads[:, 0]),
            load_blocks=np.ascontiguousarray(loads[:, 1]),
        )

    def reset(self) -> None:
        """Forget every block (new weights, or a step that failed may have left its
        copies half done): no later request finds one."""
        self._slot_of.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._busy.clear()
        self._stores, self._loads = [], []

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slot_of.items():
            if slot not in self._busy:
                del self._slot_of[block_hash]  # the least recently used one not in use
                return slot
        return None


def make_host_tier(size_gib: float, specs: list[KVCacheSpec]) -> HostKVTier | None:
    """The host tier of size_gib GiB over the workers of specs (None for 0): a slot holds
    one block of every layer of every worker, each worker its own share (its tp rank's
    heads, its pipeline stage's layers)."""
    if size_gib < 0 or not math.isfinite(size_gib):
        raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {size_gib}")
    if size_gib == 0:
        return None
    slot_bytes = sum(spec.page_size_bytes * len(spec.layer_names) for spec in specs)
    num_slots = int(size_gib * (1 << 30)) // slot_bytes
    if num_slots == 0:
        raise ValueError(
            f"kv_offloading_size {size_gib} GiB holds no block ({slot_bytes} bytes over "
            "all workers): give it more, or 0 for no host tier"
        )
    logger.info(
        "host KV tier: %d blocks of %d tokens = %.1f MiB over %d worker(s)",
        num_slots, specs[0].block_size, num_slots * slot_bytes / (1 << 20), len(specs),
    )  # fmt: skip
    return HostKVTier(num_slots)
