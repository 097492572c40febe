"""The head map of KV transfer between instances of different tensor parallel sizes (and
pipeline stages): which prefill ranks (and which of their heads and layers) each decode
rank pulls."""

from __future__ import annotations

import pytest

from zmqworker.kv_transfer.head_map import HeadMapError, HeadSource, Layers, head_map, stage_map


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
    """Stage 1 of instances of tp 2 (prefill) and 1 (decode), two stages each: the head
    map, its prefill ranks counted from the stage's first rank (2), releases included;
    the layers are the stage's own on both sides."""
    first = head_map(2, 2, 1, 0)
    staged = stage_map(2, 4, (2, 2), (1, 2), 0, 1)
    assert [s.rank for s in staged.reads] == [2, 3]
    assert [(s.first, s.count, s.dest) for s in staged.reads] == [
        (s.first, s.count, s.dest) for s in first.reads
    ]
    assert all(s.layers is None and s.readers == 1 for s in staged.reads)
    replicated = stage_map(1, 4, (2, 2), (1, 2), 0, 1)
    assert [s.rank for s in replicated.reads] == [2]
    assert [s.rank for s in replicated.releases] == [3]
    assert stage_map(2, 4, (2, 2), (1, 2), 0, 0) == first


def layers(
    heads: int, num_layers: int, prefill: tuple[int, int], decode: tuple[int, int]
) -> list[list[tuple[int, ...]]]:
    """(prefill rank, first staged layer, count, dest layer, staged layers, readers) of
    each decode stage's reads, for tp rank 0."""
    return [
        [
            (s.rank, s.layers.first, s.layers.count, s.layers.dest, s.layers.staged, s.readers)
            for s in stage_map(heads, num_layers, prefill, decode, 0, stage).reads
        ]
        for stage in range(decode[1])
    ]


def test_two_prefill_stages_into_one() -> None:
    # Each prefill stage's two layers into their place in the one stage's four.
    assert layers(2, 4, (1, 2), (1, 1)) == [[(0, 0, 2, 0, 2, 1), (1, 0, 2, 2, 2, 1)]]


def test_one_prefill_stage_into_two() -> None:
    # Each decode stage takes its half of the one stage's layers: two readers of it.
    assert layers(2, 4, (1, 1), (1, 2)) == [[(0, 0, 2, 0, 4, 2)], [(0, 2, 2, 0, 4, 2)]]


def test_uneven_stages_overlap_by_layer() -> None:
    """Five layers: prefill stages [0, 3) and [3, 5), decode [0, 2), [2, 4) and [4, 5).
    Decode stage 1 reads layer 2 of prefill stage 0 and layer 3 of stage 1; a prefill
    stage's readers are the decode stages over its layers."""
    assert layers(2, 5, (1, 2), (1, 3)) == [
        [(0, 0, 2, 0, 3, 2)],
        [(0, 2, 1, 0, 3, 2), (1, 0, 1, 1, 2, 2)],
        [(1, 1, 1, 0, 2, 2)],
    ]


def test_stages_and_tensor_parallel_sizes_both_differ() -> None:
    """Prefill tp 2 over 2 stages, decode tp 1 over 1: the one rank reads both heads of
    both stages, ranks counted over the prefill instance."""
    [reads] = [stage_map(2, 4, (2, 2), (1, 1), 0, 0).reads]
    assert [(s.rank, s.dest, s.layers) for s in reads] == [
        (0, 0, Layers(0, 2, 0, 2)),
        (1, 1, Layers(0, 2, 0, 2)),
        (2, 0, Layers(0, 2, 2, 2)),
        (3, 1, Layers(0, 2, 2, 2)),
    ]
    assert {s.readers for s in reads} == {1}


def test_more_stages_than_layers_cannot_map() -> None:
    with pytest.raises(HeadMapError, match="exceeds the model's 2 layers"):
        stage_map(2, 2, (1, 3), (1, 1), 0, 0)


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
