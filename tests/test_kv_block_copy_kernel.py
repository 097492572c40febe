"""The Triton kernel that copies a request's blocks between two caches, every layer in
one launch (kv_transfer/block_copy_kernel.py: the pull out of a producer's GPU cache),
through Triton's interpreter on the CPU (float16 and float32 exact there; bf16 on the
GPU: tests/test_kv_cuda_ipc.py): all heads, a slice of heads into other heads, rows
longer than one program's piece, and no blocks at all."""

from __future__ import annotations

import os

import pytest
import torch

from zmqworker.kv_transfer import block_copy_kernel
from zmqworker.kv_transfer.block_copy_kernel import copy_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


def layers(n: int, blocks: int, heads: int, slots: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, heads, slots, generator=g).to(dtype).to(DEVICE)
            for _ in range(n)]  # fmt: skip


def table(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=DEVICE)


def ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "heads, src_heads, dst_heads", [(None, 3, 3), ((1, 0, 2), 3, 2), ((0, 2, 1), 2, 4)]
)
def test_blocks_land_in_their_ids_and_nothing_else_moves(
    monkeypatch, dtype, heads, src_heads, dst_heads
) -> None:
    monkeypatch.setattr(block_copy_kernel, "ROW_PIECE", 16)  # rows of several pieces
    src = layers(3, 6, src_heads, 24, dtype, seed=1)
    dst = layers(3, 5, dst_heads, 24, dtype, seed=2)
    before = [t.clone() for t in dst]
    src_ids, dst_ids = [4, 0, 5], [1, 3, 2]
    copy_blocks(dst, table(dst), ids(dst_ids), table(src), ids(src_ids), (6, src_heads), heads)
    first, dest, count = heads or (0, 0, src_heads)
    for got, want, old in zip(dst, src, before, strict=True):
        expected = old.clone()
        expected[:, dst_ids, dest : dest + count] = want[:, src_ids, first : first + count]
        assert torch.equal(got, expected)


def test_no_blocks_copy_nothing_and_heads_out_of_range_are_named() -> None:
    src = layers(2, 4, 2, 8, torch.float16, seed=3)
    dst = layers(2, 4, 2, 8, torch.float16, seed=4)
    before = [t.clone() for t in dst]
    copy_blocks(dst, table(dst), ids([]), table(src), ids([]), (4, 2))
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))
    with pytest.raises(ValueError, match="heads 1..2 of 2 into 0.. of 2"):
        copy_blocks(dst, table(dst), ids([0]), table(src), ids([0]), (4, 2), (1, 0, 2))


def test_the_warm_up_copy_leaves_the_cache_as_it_was() -> None:
    from zmqworker.kv_transfer.device_copies import warm_up_copies

    cache = layers(2, 3, 2, 8, torch.bfloat16 if DEVICE == "cuda" else torch.float16, seed=5)
    before = [t.clone() for t in cache]
    warm_up_copies(cache)
    assert all(torch.equal(a, b) for a, b in zip(cache, before, strict=True))
