"""The head map of KV transfer between instances of different tensor parallel sizes:
which prefill ranks (and which of their heads) each decode rank pulls."""

from __future__ import annotations

import pytest

from zmqworker.kv_transfer.head_map import HeadMapError, HeadSource, head_map, on_stage


def reads(heads: int, prefill: int, decode: int) -> list[list[tuple[int, int, int, int]]]:
    """(prefill rank, first, count, dest) of every decode rank's reads."""
    return [
        [(s.rank, s.first, s.count, s.dest) for s in head_map(heads, prefill, decode, d).reads]
        for d in range(decode)
    ]


def test_same_size_is_rank_to_rank() -> None:
    assert reads(4, 2, 2) == [[(0, 0, 2, 0)], [(1, 0, 2, 0)]]
    assert head_map(4, 2, 2, 1).reads[0].readers == 1


def test_two_prefill_ranks_into_one() -> None:
    assert reads(4, 2, 1) == [[(0, 0, 2, 0), (1, 0, 2, 2)]]
    assert all(s.readers == 1 and s.staged_heads == 2 for s in head_map(4, 2, 1, 0).reads)


def test_one_prefill_rank_into_two() -> None:
    assert reads(4, 1, 2) == [[(0, 0, 2, 0)], [(0, 2, 2, 0)]]
    assert head_map(4, 1, 2, 0).reads[0] == HeadSource(0, 0, 2, 0, 4, readers=2)


def test_a_later_stage_reads_the_ranks_of_its_prefill_stage() -> None:
    """Stage 1 of instances of tp 2 (prefill) and 1 (decode): the same map, its prefill
    ranks counted from the stage's first rank (2), releases included."""
    first = head_map(2, 2, 1, 0)
    staged = on_stage(first, 2)
    assert [s.rank for s in staged.reads] == [2, 3]
    assert [(s.first, s.count, s.dest) for s in staged.reads] == [
        (s.first, s.count, s.dest) for s in first.reads
    ]
    replicated = on_stage(head_map(1, 2, 1, 0), 4)
    assert [s.rank for s in replicated.reads] == [4]
    assert [s.rank for s in replicated.releases] == [5]
    assert on_stage(first, 0) is first


def test_four_into_two_and_two_into_four() -> None:
    assert reads(8, 4, 2) == [[(0, 0, 2, 0), (1, 0, 2, 2)], [(2, 0, 2, 0), (3, 0, 2, 2)]]
    assert reads(8, 2, 4) == [[(0, 0, 2, 0)], [(0, 2, 2, 0)], [(1, 0, 2, 0)], [(1, 2, 2, 0)]]
    assert {s.readers for d in range(4) for s in head_map(8, 2, 4, d).reads} == {2}


def test_one_kv_head_replicated() -> None:
    # Decode ranks holding the same head spread over its replicas.
    assert reads(1, 2, 2) == [[(0, 0, 1, 0)], [(1, 0, 1, 0)]]
    assert reads(1, 1, 2) == [[(0, 0, 1, 0)], [(0, 0, 1, 0)]]
    # A replica nobody reads is released, so its server drops the staged KV at once.
    one = head_map(1, 2, 1, 0)
    assert [(s.rank, s.count) for s in one.reads] == [(0, 1)]
    assert [(s.rank, s.count, s.readers) for s in one.releases] == [(1, 0, 1)]
    two = [head_map(2, 4, 2, d) for d in range(2)]
    assert [[s.rank for s in m.reads] for m in two] == [[0], [2]]
    assert [[s.rank for s in m.releases] for m in two] == [[1], [3]]


@pytest.mark.parametrize(
    ("heads", "prefill", "decode", "words"),
    [
        (4, 3, 1, "4 key/value heads are not divisible by tensor parallel size 3"),
        (2, 1, 3, "tensor parallel size 3 is not a multiple of the 2 key/value heads"),
    ],
)
def test_sizes_that_cannot_map(heads: int, prefill: int, decode: int, words: str) -> None:
    with pytest.raises(HeadMapError, match=words):
        head_map(heads, prefill, decode, 0)


def test_rank_out_of_range() -> None:
    with pytest.raises(HeadMapError, match="decode rank 2 out of tensor parallel size 2"):
        head_map(4, 2, 2, 2)


def test_a_remote_kv_of_no_prefill_rank() -> None:
    """A RemoteKV naming no address: refused by name, not a division by zero."""
    with pytest.raises(HeadMapError, match="prefill instance's tensor parallel size is 0"):
        head_map(4, 0, 1, 0)
