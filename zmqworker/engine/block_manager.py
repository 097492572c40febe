"""The KV block pool: which cache blocks each request owns, and the prefix cache.

Blocks are the workers' KV cache pages (block_size tokens each, in every layer). The
engine owns the bookkeeping; workers only ever see block ids. With prefix caching, a FULL
block is named by a chained hash of all token ids up to its end, so a later request with
the same prefix reuses the computed block instead of recomputing it. Freed blocks keep
their content (and hash) until the pool hands them out again, least recently freed first;
with a host tier (host_tier.py), their KV moves there then, to be loaded back on a hit.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from zmqworker.cdiv import cdiv
from zmqworker.engine.host_tier import HostKVTier

_NEVER = sys.maxsize  # registered blocks of a request that is never to register any

_ROOT_HASH = b""


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its tokens chained to the hash of everything before it."""
    return hashlib.sha256(parent + np.asarray(token_ids, np.int64).tobytes()).digest()


class KVBlockManager:
    """Allocates block ids to requests. Not thread-safe: the scheduler owns it (but for
    num_cached_tokens, which only looks up)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        host_tier: HostKVTier | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError(
                "a host KV tier keeps the blocks the prefix cache evicts: it needs prefix "
                "caching on (enable_prefix_caching)"
            )
        self.host_tier = host_tier
        # Blocks nobody references, in reuse order: the first is handed out next.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        # Prefix cache: hash -> block, and each cached block's hash.
        self._cached: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        # Per request: hashes of its leading full blocks, and how many of its blocks
        # (counted from the start) are registered in the cache or were found there.
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        # Blocks registered while building the current step: their keys are computed in
        # that same step, and a worker may read a step's context before writing its keys.
        self._fresh: set[int] = set()
        self.weights_version = 0  # weight changes so far: the cache's KV is of the last

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, cached or not)."""
        return len(self._free)

    @property
    def num_host_blocks(self) -> int:
        """Slots of the host tier (0: none)."""
        return self.host_tier.num_slots if self.host_tier is not None else 0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - len(self._free) / self.num_blocks

    def holds(self, req_id: str) -> bool:
        """Whether req_id holds blocks (a table, maybe empty)."""
        return req_id in self._tables

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table (a copy); empty if it holds no blocks."""
        return list(self._tables.get(req_id, ()))

    def never_register(self, req_id: str) -> None:
        """req_id's KV came from other weights (pulled from an instance that had them):
        none of its blocks is to be shared, as after a reset."""
        self._num_registered[req_id] = _NEVER

    def holds_stale_kv(self, req_id: str) -> bool:
        """Whether req_id's blocks hold KV from before the last reset_prefix_cache (old
        weights, or a cache that slept): no other request is to take them."""
        return self._num_registered.get(req_id) == _NEVER

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def new_step(self) -> None:
        """Start building a new step: blocks registered so far become prefix-cache hits."""
        self._fresh.clear()
        if self.host_tier is not None:
            self.host_tier.new_step()

    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """(blocks, tokens) of the longest cached prefix of token_ids, in full blocks.

        At least one token is always left to compute, because the last prompt position
        must run through the model to sample from. Nothing is referenced yet: pass the
        blocks to allocate_slots.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes(req_id, token_ids, (len(token_ids) - 1) // self.block_size)
        blocks: list[int] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None or block in self._fresh:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of token_ids' longest prefix, in full blocks and a token short of all at
        most, that the prefix cache holds and the host tier after it (as a request finds
        them: get_computed_blocks, then get_host_hits): what a request of these tokens
        would not compute. Changes nothing and only looks blocks up, so that a router on
        another thread may ask it (threaded_router.py): its answer is a guess as soon as
        a step runs."""
        if not self.enable_prefix_caching:
            return 0
        size, parent, num_blocks, in_host = self.block_size, _ROOT_HASH, 0, False
        for i in range((len(token_ids) - 1) // size):
            parent = hash_block(parent, token_ids[i * size : (i + 1) * size])
            in_host = in_host or parent not in self._cached
            if in_host and (self.host_tier is None or parent not in self.host_tier):
                break
            num_blocks += 1
        return num_blocks * size

    def get_host_hits(self, req_id: str, token_ids: Sequence[int], num_hits: int) -> list[int]:
        """The host tier's slots of the full blocks that follow the num_hits blocks
        get_computed_blocks found, as far as the tier holds them (at least one token
        is left to compute). Pass them to allocate_slots as host_slots."""
        if self.host_tier is None:
            return []
        hashes = self._hashes(req_id, token_ids, (len(token_ids) - 1) // self.block_size)
        return self.host_tier.find(hashes[num_hits:])

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        num_placeholders: int = 0,
        host_slots: Sequence[int] = (),
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens of req_id; return the block ids newly
        taken from the pool, or None (changing nothing) when there are not enough.

        token_ids are all the request's known tokens: num_computed_tokens + num_new_tokens
        of them, but for num_placeholders at the end that a step in flight will sample
        (async scheduling; a block is registered for prefix caching only once all of its
        tokens are known). computed_blocks, from get_computed_blocks, are prefix-cache
        hits that start a request holding no blocks yet; host_slots, from get_host_hits,
        the blocks after them that the host tier loads into the first new blocks (their
        tokens counted in num_computed_tokens).
        """
        if num_new_tokens < 1:
            raise ValueError(f"{req_id}: num_new_tokens must be >= 1, got {num_new_tokens}")
        total = num_computed_tokens + num_new_tokens
        if total > len(token_ids) + num_placeholders:
            raise ValueError(
                f"{req_id}: {total} tokens to hold but only {len(token_ids)} token ids known"
            )
        num_full = min(total, len(token_ids)) // self.block_size
        table = self._tables.get(req_id, [])
        if (
            not computed_blocks
            and total <= len(table) * self.block_size
            and (not self.enable_prefix_caching or num_full <= self._num_registered.get(req_id, 0))
        ):
            return []  # the common decode step: room left, no block newly full
        if (computed_blocks or host_slots) and table:
            raise ValueError(f"{req_id}: prefix-cache hits given for a request holding blocks")
        held = len(table) + len(computed_blocks)
        if num_computed_tokens > (held + len(host_slots)) * self.block_size:
            raise ValueError(
                f"{req_id}: {num_computed_tokens} computed tokens but only "
                f"{held + len(host_slots)} blocks held or loaded"
            )
        num_needed = max(0, cdiv(total, self.block_size) - held)
        # Hits on free cached blocks leave the free list, so they count against it.
        free_hits = sum(1 for b in computed_blocks if self._ref_counts[b] == 0)
        if num_needed > len(self._free) - free_hits:
            return None
        for block in computed_blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        new_blocks = [self._take_free_block() for _ in range(num_needed)]
        if host_slots:
            assert self.host_tier is not None
            self.host_tier.load(host_slots, new_blocks[: len(host_slots)])
        table = self._tables.setdefault(req_id, table)
        table.extend(computed_blocks)
        table.extend(new_blocks)
        if computed_blocks:
            self._num_registered[req_id] = len(computed_blocks)
        if self.enable_prefix_caching:
            self._register_full_blocks(req_id, token_ids, num_full)
        return new_blocks

    def allocate_pending(self, req_id: str, token_ids: Sequence[int]) -> int | None:
        """Blocks for token_ids, the prompt of a request holding none whose KV is to come
        from another instance; how many leading blocks hold that KV here already, or None
        (changing nothing) when there are not enough blocks. Those are the prefix cache's
        hits (referenced as any hit) and the host tier's after them (loaded back by the
        step being built), a token short of the prompt at most, as for any prefix hit.
        The blocks after them are not registered for prefix caching, so no other request
        reads them before their KV has come; allocate_slots registers them once the
        request is scheduled."""
        if req_id in self._tables:
            raise ValueError(f"{req_id}: already holds blocks")
        hits, _ = self.get_computed_blocks(req_id, token_ids)
        host_slots = self.get_host_hits(req_id, token_ids, len(hits))
        num_cached = len(hits) + len(host_slots)
        num_hit = num_cached * self.block_size
        num_tokens = len(token_ids)
        blocks = self.allocate_slots(
            req_id, (), num_hit, num_tokens - num_hit, hits, num_tokens, host_slots
        )
        return None if blocks is None else num_cached

    def free(self, req_id: str) -> None:
        """Release every block of req_id. Cached blocks stay findable until reused; the
        request's last blocks go first, since a shorter prefix is likelier to be shared."""
        table = self._tables.pop(req_id, [])
        self._req_hashes.pop(req_id, None)
        self._num_registered.pop(req_id, None)
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._block_hash:
                    # Nothing worth keeping in it: hand it out before any cached block.
                    self._free.move_to_end(block, last=False)

    def reset_prefix_cache(self, new_weights: bool = False) -> None:
        """Forget every cached block (new weights, or a KV cache that slept): no later
        request finds one. Blocks stay with the requests that hold them, as private
        blocks, and those requests never register one: what they compute from here on
        attends to the KV from before (one preempted starts over, and registers anew).
        new_weights: new weights are in, whole (weights_version counts them)."""
        if new_weights:
            self.weights_version += 1
        self._cached.clear()
        self._block_hash.clear()
        self._fresh.clear()
        for req_id in self._tables:
            self._num_registered[req_id] = _NEVER
        if self.host_tier is not None:
            self.host_tier.reset()

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        block_hash = self._block_hash.pop(block, None)
        if block_hash is not None:
            del self._cached[block_hash]
            if self.host_tier is not None and block not in self._fresh:
                self.host_tier.evicted(block, block_hash)  # stored before it is written
            self._fresh.discard(block)
        self._ref_counts[block] = 1
        return block

    def _hashes(self, req_id: str, token_ids: Sequence[int], num_full: int) -> list[bytes]:
        """The request's first num_full block hashes, extending its memo as needed."""
        hashes = self._req_hashes.setdefault(req_id, [])
        size = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, token_ids[i * size : (i + 1) * size]))
        return hashes[:num_full]

    def _register_full_blocks(self, req_id: str, token_ids: Sequence[int], num_full: int) -> None:
        start = self._num_registered.get(req_id, 0)
        if num_full <= start:
            return
        table = self._tables[req_id]
        hashes = self._hashes(req_id, token_ids, num_full)
        for i in range(start, num_full):
            # A block computed twice (two requests with one prefix in one step) stays
            # private: the cache keeps the first.
            if hashes[i] not in self._cached and table[i] not in self._block_hash:
                self._cached[hashes[i]] = table[i]
                self._block_hash[table[i]] = hashes[i]
                self._fresh.add(table[i])
        self._num_registered[req_id] = num_full
