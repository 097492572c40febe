"""Which prefill ranks' KV heads (and layers) a decode rank pulls, when the two instances
have different tensor parallel sizes (or pipeline stages).

Both sides hold heads by the model's rule (models/llama.py, kv_heads_of_rank): rank r
of a TP size T holds a contiguous range of the global KV heads, or, with fewer heads
than ranks, one head replicated on T / num_kv_heads consecutive ranks. A decode rank
reads each of its heads from a prefill rank holding it; where a head is replicated on
the prefill side, the decode ranks holding it spread over its replicas, and a replica
no decode rank reads from is still told by one of them that it may let go (a release:
a pull of no heads), so that every prefill rank frees its staged KV once all its readers
are done, never only at the timeout.

Both sides split the layers over their pipeline stages by the model's rule too
(models/llama.py, pp_layer_range). Where the stage counts differ, a decode stage pulls
from every prefill stage holding some of its layers those layers alone, each such stage's
ranks by the head map; a prefill rank's readers are then the head map's times the
decode stages that read its stage.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import msgspec

from messages.kv_peer import KVLayout
from zmqworker.models.llama import kv_heads_of_rank, pp_layer_range


@dataclass(frozen=True)
class Layers:
    """Layers first .. first + count - 1 of a prefill stage's staged KV (staged layers
    in all) go to layers dest .. dest + count - 1 of this rank's cache."""

    first: int
    count: int
    dest: int
    staged: int


@dataclass(frozen=True)
class HeadSource:
    """Heads first .. first + count - 1 of prefill rank `rank`'s staged KV (staged_heads
    heads in all) go to heads dest .. dest + count - 1 of this rank's cache; count 0: a
    release (nothing read). readers: how many decode ranks contact that prefill rank for
    a request, so its server knows when all are done. layers: the layers it takes, where
    the two instances split the layers over their stages differently; None where alike
    (the prefill stage's layers are this rank's)."""

    rank: int
    first: int
    count: int
    dest: int
    staged_heads: int
    readers: int
    layers: Layers | None = None

    def heads(self, held: int, mine: int) -> tuple[int, int, int] | None:
        """copy_blocks' heads (first, dest, count) for this piece out of a producer's
        cache of held heads into this rank's of mine: None where it is all of both."""
        return None if self.count == held == mine else (self.first, self.dest, self.count)

    def staged_layout(self, mine: KVLayout) -> KVLayout:
        """The producer's staging, where this rank's cache is mine."""
        layers = mine.num_layers if self.layers is None else self.layers.staged
        return msgspec.structs.replace(mine, num_kv_heads=self.staged_heads, num_layers=layers)

    def taken_layout(self, mine: KVLayout) -> KVLayout:
        """The piece this source gives: its heads of the layers it takes."""
        taken, _ = self.layer_slices(mine.num_layers)
        count = taken.stop - taken.start
        return msgspec.structs.replace(mine, num_kv_heads=self.count, num_layers=count)

    def layer_slices(self, mine: int) -> tuple[slice, slice]:
        """(the staged layers this piece takes, the layers of this rank's cache (of mine)
        they go to)."""
        if self.layers is None:
            return slice(0, mine), slice(0, mine)
        first, count, dest = self.layers.first, self.layers.count, self.layers.dest
        return slice(first, first + count), slice(dest, dest + count)


@dataclass(frozen=True)
class HeadMap:
    """A decode rank's sources: reads (count > 0), then releases (count 0)."""

    reads: tuple[HeadSource, ...]
    releases: tuple[HeadSource, ...]


class HeadMapError(ValueError):
    pass


def head_map(num_kv_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> HeadMap:
    """Decode rank `rank`'s sources; HeadMapError names sizes that cannot map."""
    if prefill_tp < 1:
        raise HeadMapError(f"the prefill instance's tensor parallel size is {prefill_tp}")
    if not 0 <= rank < decode_tp:
        raise HeadMapError(f"decode rank {rank} out of tensor parallel size {decode_tp}")
    return _all_maps(num_kv_heads, prefill_tp, decode_tp)[rank]


@functools.lru_cache(maxsize=64)
def _all_maps(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadMap, ...]:
    prefill = [_holds(num_kv_heads, prefill_tp, p, "prefill") for p in range(prefill_tp)]
    decode = [_holds(num_kv_heads, decode_tp, d, "decode") for d in range(decode_tp)]
    # (decode rank, prefill rank) -> [(global head, head in the prefill rank's staged KV)]
    reads: dict[tuple[int, int], list[int]] = {}
    releases: set[tuple[int, int]] = set()
    for head in range(num_kv_heads):
        holders = [p for p in range(prefill_tp) if head in prefill[p]]
        takers = [d for d in range(decode_tp) if head in decode[d]]
        for i, d in enumerate(takers):
            reads.setdefault((d, holders[i % len(holders)]), []).append(head)
        for j in range(len(takers), len(holders)):
            releases.add((takers[j % len(takers)], holders[j]))
    releases -= reads.keys()
    readers = [0] * prefill_tp
    for _, p in [*reads, *releases]:
        readers[p] += 1
    maps = []
    for d in range(decode_tp):
        mine = []
        for (rd, p), heads in sorted(reads.items()):
            if rd == d:
                assert heads == list(range(heads[0], heads[0] + len(heads))), heads
                mine.append(HeadSource(
                    p, heads[0] - prefill[p].start, len(heads), heads[0] - decode[d].start,
                    len(prefill[p]), readers[p],
                ))  # fmt: skip
        freed = [
            HeadSource(p, 0, 0, 0, len(prefill[p]), readers[p])
            for rd, p in sorted(releases)
            if rd == d
        ]
        maps.append(HeadMap(tuple(mine), tuple(freed)))
    return tuple(maps)


def stage_map(
    num_kv_heads: int,
    num_layers: int,
    prefill: tuple[int, int],
    decode: tuple[int, int],
    tp_rank: int,
    pp_rank: int,
) -> HeadMap:
    """The sources of decode rank tp_rank of stage pp_rank, its prefill ranks counted over
    the instance (stage * tp + tp rank). prefill, decode: each instance's (tensor
    parallel size, pipeline stages); num_layers: the model's. HeadMapError names sizes
    that cannot map."""
    (prefill_tp, prefill_pp), (decode_tp, decode_pp) = prefill, decode
    heads = head_map(num_kv_heads, prefill_tp, decode_tp, tp_rank)
    if prefill_pp == decode_pp:  # the same layers, in the stage of this number
        return _placed(heads, pp_rank * prefill_tp, 1, None)
    try:
        stages = [pp_layer_range(num_layers, s, prefill_pp) for s in range(prefill_pp)]
        ours = [pp_layer_range(num_layers, s, decode_pp) for s in range(decode_pp)]
    except ValueError as e:
        raise HeadMapError(f"the model's layers cannot be mapped: {e}") from None
    start, end = ours[pp_rank]
    reads: list[HeadSource] = []
    releases: list[HeadSource] = []
    for stage, (first, last) in enumerate(stages):
        low, high = max(start, first), min(end, last)
        if low >= high:
            continue
        readers = sum(1 for a, b in ours if max(a, first) < min(b, last))
        layers = Layers(low - first, high - low, low - start, last - first)
        placed = _placed(heads, stage * prefill_tp, readers, layers)
        reads += placed.reads
        releases += placed.releases
    return HeadMap(tuple(reads), tuple(releases))


def _placed(heads: HeadMap, first_rank: int, stages: int, layers: Layers | None) -> HeadMap:
    """heads with its prefill ranks counted from first_rank (the first rank of the
    prefill stage read), its readers times the decode stages reading that stage, and
    layers."""
    placed = [
        tuple(
            dataclasses.replace(
                s, rank=first_rank + s.rank, readers=s.readers * stages, layers=layers
            )
            for s in sources
        )
        for sources in (heads.reads, heads.releases)
    ]
    return HeadMap(*placed)


def _holds(num_kv_heads: int, tp: int, rank: int, side: str) -> range:
    try:
        per_rank, first = kv_heads_of_rank(num_kv_heads, tp, rank)
    except ValueError as e:
        raise HeadMapError(f"the {side} instance's KV heads cannot be mapped: {e}") from None
    return range(first, first + per_rank)
