"""The decode graph's greedy ids (model_runner/greedy_ids.py) against torch's argmax.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from zmqworker.model_runner.greedy_ids import CHUNK, GreedyIds  # noqa: E402

DEVICE = torch.device(os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu"))


def _ids(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full((logits.shape[0],), -7, dtype=torch.int32, device=logits.device)
    assert GreedyIds(logits.shape[0], logits.device)(logits, out) is out
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 2 * CHUNK + 77])
def test_greedy_ids_are_torchs_argmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype).to(DEVICE)
    torch.testing.assert_close(_ids(logits), logits.argmax(-1).to(torch.int32))


def test_ties_go_to_the_first_largest_within_and_across_chunks():
    vocab = 2 * CHUNK + 77
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [5, 9]] = 3.0  # within a chunk
    logits[1, [CHUNK - 1, CHUNK, 2 * CHUNK + 3]] = 3.0  # across chunks: the first
    logits[2, [2 * CHUNK + 76, CHUNK + 1]] = 3.0  # the later chunk's is first in order
    logits[3] = float("-inf")  # nothing is larger than -inf: index 0, as torch
    assert _ids(logits).tolist() == [5, CHUNK - 1, CHUNK + 1, 0]
    assert logits.argmax(-1).tolist() == [5, CHUNK - 1, CHUNK + 1, 0]


def test_nan_wins_and_rows_may_be_strided():
    wide = torch.randn(3, 3000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits = wide[:, :2500]  # a row stride of 3000
    logits[1, 1234] = float("nan")
    logits[2, 2499] = 1e4
    assert _ids(logits).tolist() == logits.argmax(-1).tolist()
    assert _ids(logits)[1:].tolist() == [1234, 2499]


def test_greedy_ids_refuses_what_it_cannot_write():
    logits = torch.randn(2, 64, device=DEVICE)
    greedy = GreedyIds(64, DEVICE)
    with pytest.raises(ValueError, match="unit last stride"):
        greedy(logits.T, torch.zeros(64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be int32 \[2\]"):
        greedy(logits, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be int32 \[2\]"):
        greedy(logits, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="greedy ids of 2 rows on .*: this kernel takes up to 1"):
        GreedyIds(1, DEVICE)(logits, torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_a_count_on_the_device_bounds_the_rows_written():
    """A graph's step samples fewer rows than it computes: the rows past its count keep
    what they held (an earlier step's samples, for the token feed). One kernel object
    serves every call, as a graph replays it: each leaves its counters as it found them."""
    logits = torch.randn(4, CHUNK + 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ids = logits.argmax(-1).tolist()
    greedy = GreedyIds(4, DEVICE)
    for count, expect in [(0, [-7] * 4), (3, [*ids[:3], -7]), (4, ids), (1, [ids[0], *[-7] * 3])]:
        out = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
        greedy(logits, out, torch.tensor([count], dtype=torch.int32, device=DEVICE))
        assert out.tolist() == expect, count
    with pytest.raises(ValueError, match="count must be one int32"):
        greedy(logits, out, torch.tensor([1, 2], dtype=torch.int32, device=DEVICE))


def test_one_kernel_object_gives_each_call_its_own_ids():
    """Each row's last chunk to finish writes its id and zeroes its counter: calls after
    it, with other logits and fewer rows, find the first largest of their own."""
    greedy = GreedyIds(3, DEVICE)
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in [(3, 3 * CHUNK), (2, CHUNK + 1), (3, 3 * CHUNK), (1, 7)]:
        logits = torch.randn(rows, vocab, generator=gen).to(DEVICE)
        assert _ids_with(greedy, logits) == logits.argmax(-1).tolist(), (rows, vocab)


def _ids_with(greedy: GreedyIds, logits: torch.Tensor) -> list[int]:
    out = torch.full((logits.shape[0],), -7, dtype=torch.int32, device=logits.device)
    return greedy(logits, out).tolist()
