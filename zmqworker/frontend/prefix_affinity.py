"""Which engine core most likely holds a prompt's prefix in its cache, as far as this
client can tell: where it sent the prompts before. Among the engine cores within SLACK
requests of the least loaded, a request goes to the one that was sent the longest prefix
of its prompt (its full blocks, by chained hashes), the less loaded of equals; where none
of them was sent any of it, to the least loaded.

Only among engine cores that all keep a prefix cache (EngineCoreReady.prefix_caching),
of one block size. Each engine core's record keeps the hashes of the blocks it was sent
last, as many as its cache holds (EngineCoreReady.num_blocks), a prompt's last blocks
forgotten before its first (as the engine core's cache evicts them). A guess, not the
cache's state: the engine core may have evicted a block since, or dropped its cache (a
reset, sleep, a weight update), and each client (each API server) keeps its own. A wrong
guess costs a prefill, never a token: the engine core's prefix cache decides what it
reuses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from messages import EngineCoreReady

# Requests above the least loaded engine core that a cached prefix is worth.
SLACK = 16
# Prompt blocks hashed: a prefix this long already tells the engine cores apart (the
# disaggregated router keeps its decode instances' records whole: it counts on them).
MAX_BLOCKS = 256


class Engine(Protocol):
    index: int
    dead: Exception | None
    disconnected_at: float | None  # its connection dropped: it may be gone

    @property
    def load(self) -> int: ...


E = TypeVar("E", bound=Engine)


def place(
    tokens: np.ndarray,
    engines: Sequence[E],
    affinity: PrefixAffinity | None,
    max_blocks: int | None = MAX_BLOCKS,
) -> E:
    """The engine core of engines for a prompt of tokens: by affinity (None: the least
    loaded), among the live ones, those whose connection holds first; the error of a dead
    one where none is live. max_blocks: as prompt_hashes'."""
    live = [e for e in engines if e.dead is None]
    if not live:
        raise engines[0].dead.with_traceback(None)  # type: ignore[union-attr]
    live = [e for e in live if e.disconnected_at is None] or live
    if affinity is None:
        return min(live, key=lambda e: (e.load, e.index))
    # Recorded even where one engine core is left to choose: the record is its cache's.
    hashes = prompt_hashes(tokens, affinity.block_size, max_blocks)
    engine = affinity.choose(hashes, live)
    affinity.sent(engine.index, hashes)
    return engine


def prompt_hashes(
    tokens: np.ndarray, block_size: int, max_blocks: int | None = MAX_BLOCKS
) -> list[int]:
    """The chained hashes of the prompt's full blocks (up to max_blocks; None: all of
    them): the i-th names the prompt's first i + 1 blocks. Python's hash, not the block manager's
    sha256 (hash_block): no other process reads these, and it costs several times less
    on the client's path for every request."""
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    data = np.ascontiguousarray(tokens[: full * block_size], dtype=np.int32).tobytes()
    width = block_size * 4
    hashes, last = [], 0
    for start in range(0, len(data), width):
        last = hash((last, data[start : start + width]))
        hashes.append(last)
    return hashes


class PrefixAffinity:
    def __init__(self, block_size: int, capacity: dict[int, int]) -> None:
        """capacity: each engine core's (by index) cache size in blocks."""
        if block_size <= 0 or any(c <= 0 for c in capacity.values()):
            raise ValueError(f"block size {block_size} and cache blocks {capacity} must be > 0")
        self.block_size = block_size
        self._capacity = capacity
        self._sent: dict[int, OrderedDict[int, None]] = {i: OrderedDict() for i in capacity}

    @classmethod
    def of(cls, readies: dict[int, EngineCoreReady | None]) -> PrefixAffinity | None:
        """The affinity of the engine cores (by index) that said these Readies: None for
        one, where one keeps no prefix cache (or no block), or where they differ in block
        size (their blocks do not match)."""
        kept = [r for r in readies.values() if r and r.prefix_caching and r.num_blocks > 0]
        sizes = {r.block_size for r in kept}
        if len(readies) < 2 or len(kept) < len(readies) or len(sizes) != 1 or 0 in sizes:
            return None
        return cls(sizes.pop(), {i: r.num_blocks for i, r in readies.items() if r})

    def choose(self, hashes: list[int], live: Sequence[E]) -> E:
        """The engine core among live (not empty) for a prompt of these hashes."""
        least = min(e.load for e in live)
        within = [e for e in live if e.load <= least + SLACK]
        return max(within, key=lambda e: (self.matched(hashes, e.index), -e.load, -e.index))

    def matched(self, hashes: list[int], index: int) -> int:
        """How many leading blocks of a prompt of these hashes engine core index was sent."""
        sent = self._sent[index]
        return next((i for i, h in enumerate(hashes) if h not in sent), len(hashes))

    def forget(self, index: int, hashes: list[int]) -> None:
        """Engine core index does not hold these blocks (it said so)."""
        record = self._sent[index]
        for h in hashes:
            record.pop(h, None)

    def sent(self, index: int, hashes: list[int]) -> None:
        """Engine core index was sent a prompt of these hashes."""
        record = self._sent[index]
        for h in reversed(hashes):  # the first block the newest: evicted last
            record[h] = None
            record.move_to_end(h)
        while len(record) > self._capacity[index]:
            record.popitem(last=False)
