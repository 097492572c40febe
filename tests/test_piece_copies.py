"""Pieces of host memory copied in one call (kv_transfer/piece_copies.py): byte for byte
as slices would copy them, in the kernel's call and in the fallback where the kernel
refuses it, over more pieces than one call takes; a piece outside either tensor refused
before anything is copied; a copy the kernel fails raised, not left half done unsaid."""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import pytest
import torch

from zmqworker.kv_transfer import piece_copies
from zmqworker.kv_transfer.piece_copies import copy_pieces


@pytest.fixture(params=["kernel", "slices"])
def mode(request, monkeypatch) -> str:
    if request.param == "kernel" and not piece_copies._kernel_takes_it():
        pytest.skip("the kernel refuses process_vm_readv here")
    monkeypatch.setattr(piece_copies, "in_kernel", lambda: request.param == "kernel")
    return request.param


def reference(dst: torch.Tensor, src: torch.Tensor, to, at, lengths) -> torch.Tensor:
    want = dst.clone().view(torch.uint8)
    flat = src.view(torch.uint8)
    for d, s, n in zip(to, at, lengths, strict=True):
        want[d : d + n] = flat[s : s + n]
    return want


def test_pieces_land_as_slices_would_copy_them(mode) -> None:
    """Pieces of uneven lengths (one empty), out of order, over more than IOV_MAX."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    count = piece_copies._IOV_MAX + 300
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 24, count)
    to = rng.permutation(count) * 32  # disjoint in dst
    at = rng.integers(0, src.nbytes - 24, count)
    want = reference(dst, src, to, at, lengths)
    copy_pieces(dst, src, to, at, lengths)
    assert torch.equal(dst, want)


def test_tensors_of_any_dtype_copy_as_bytes(mode) -> None:
    src = torch.arange(64, dtype=torch.float32).view(4, 16)
    dst = torch.zeros(8, 16, dtype=torch.float32)
    copy_pieces(dst, src, np.array([64 * 7, 0]), np.array([0, 64 * 3]), np.array([64, 64]))
    assert torch.equal(dst[7], src[0]) and torch.equal(dst[0], src[3])
    assert not dst[1:7].any()
    copy_pieces(dst, src, np.array([], dtype=np.int64), np.array([]), np.array([]))


@pytest.mark.parametrize(
    ("to", "at", "lengths", "error"),
    [
        ([0, 60], [0, 0], [4, 8], "a destination piece outside the 64 bytes"),
        ([0], [30], [4], "a source piece outside the 32 bytes"),
        ([-1], [0], [4], "a destination piece outside"),
        ([0], [-8], [4], "a source piece outside"),
        ([0], [0], [-4], "a destination piece outside"),
        ([0, 4], [0], [4, 4], "2 destinations, 1 sources, 2 lengths"),
        ([8], [8], [2**63 - 4], "a destination piece outside"),  # a sum would wrap
    ],
)
def test_a_piece_outside_either_tensor_is_refused_before_any_copy(
    mode, to, at, lengths, error
) -> None:
    src = torch.ones(32, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=error):
        copy_pieces(dst, src, np.array(to), np.array(at), np.array(lengths))
    assert not dst.any()


def test_strided_or_device_tensors_are_refused(mode) -> None:
    src = torch.ones(8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="strides"):
        copy_pieces(torch.zeros(8, 8, dtype=torch.uint8), src.t(), [0], [0], [4])


def test_a_copy_the_kernel_fails_raises(monkeypatch) -> None:
    """Into read-only memory (a mapping no caller passes as a destination): the kernel's
    call fails, and says how much it copied."""
    if not piece_copies._kernel_takes_it():
        pytest.skip("the kernel refuses process_vm_readv here")
    monkeypatch.setattr(piece_copies, "in_kernel", lambda: True)
    fd = os.memfd_create("piece-copies-test")
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        memory = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        read_only = torch.frombuffer(memory, dtype=torch.uint8)
    with pytest.raises(OSError, match="copied -1 of 16 bytes"):
        copy_pieces(read_only, torch.ones(16, dtype=torch.uint8), [0], [0], [16])
    del read_only
    memory.close()


def test_one_thread_copies_in_slices() -> None:
    """On one thread slices copy faster than the kernel's call (docs/kv_transfer.md)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert not piece_copies.in_kernel()
        torch.set_num_threads(2)
        assert piece_copies.in_kernel() == piece_copies._kernel_takes_it()
    finally:
        torch.set_num_threads(threads)
