"""The KV transfer's shared memory (zmqworker/kv_transfer/staging.py): a producer's memfds
come back for reuse; a consumer's mappings of them are reused by inode and unmapped only
when no arrival reads them, the unused ones beyond MAX_KEPT first. On a GPU both are
page-locked once, and a page-lock the driver refuses leaves no error for the next kernel.
"""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from zmqworker.distributed.page_lock import page_lock
from zmqworker.kv_transfer.staging import MAX_KEPT, MemfdPool, PeerMappings

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_a_memfd_given_back_is_taken_again_when_it_fits() -> None:
    pool = MemfdPool(None)
    try:
        small, large = pool.take(4096), pool.take(3 * 4096)
        pool.give_back(small)
        pool.give_back(large)
        assert pool.take(2 * 4096) is large  # the smallest that fits
        assert pool.take(4096) is small
        assert pool.take(4096) not in (small, large)  # none left: a new one
    finally:
        pool.close()


def test_past_max_kept_the_memfd_given_back_longest_ago_goes() -> None:
    pool = MemfdPool(None)
    small = [pool.take(4096) for _ in range(MAX_KEPT)]
    large = pool.take(1 << 20)
    try:
        for memfd in [*small, large]:
            pool.give_back(memfd)
        assert small[0].memory.closed  # the oldest
        assert pool.take(1 << 20) is large  # the large one stays for the next staging
    finally:
        large.close()
        pool.close()


def test_a_mapping_is_reused_and_unmapped_only_when_nobody_reads_it() -> None:
    pool, mappings = MemfdPool(None), PeerMappings(None)
    memfds = [pool.take(4096) for _ in range(MAX_KEPT + 2)]
    try:
        memfds[0].memory[:5] = b"first"
        read = mappings.acquire(os.getpid(), memfds[0].fd, 4096)
        assert mappings.acquire(os.getpid(), memfds[0].fd, 4096) is read  # by inode
        assert read.users == 2 and read.memory[:5] == b"first"
        others = [mappings.acquire(os.getpid(), m.fd, 4096) for m in memfds[1:]]
        for mapping in others:
            mappings.release(mapping)
        # MAX_KEPT + 2 mapped: the oldest unused ones go, the one still read stays.
        assert read.memory[:5] == b"first"
        assert [m.memory.closed for m in others] == [True, True] + [False] * (MAX_KEPT - 1)
        mappings.release(read)
        mappings.release(read)
        assert not read.memory.closed  # among the MAX_KEPT most recent: kept
        fresh = mappings.acquire(os.getpid(), memfds[1].fd, 4096)
        mappings.release(fresh)
        assert read.memory.closed  # now the oldest unused one beyond MAX_KEPT
    finally:
        mappings.close()
        for memfd in memfds:
            memfd.close()


def test_a_refused_peer_memfd_is_named() -> None:
    mappings = PeerMappings(None)
    with open(os.devnull) as f, pytest.raises(Exception, match="not a KV memfd"):
        mappings.acquire(os.getpid(), f.fileno(), 1)


def test_a_memfd_fd_that_now_names_another_memfd_is_refused_by_inode() -> None:
    """A staging's fd number, taken by another memfd after the staging went, is not read."""
    pool, mappings = MemfdPool(None), PeerMappings(None)
    memfd = pool.take(4096)
    try:
        inode = os.fstat(memfd.fd).st_ino
        mappings.release(mappings.acquire(os.getpid(), memfd.fd, 4096, inode))
        with pytest.raises(ValueError, match=f"fd {memfd.fd} is another memfd now"):
            mappings.acquire(os.getpid(), memfd.fd, 4096, inode + 1)
    finally:
        memfd.close()
        mappings.close()
        pool.close()


@CUDA
def test_memfds_and_mappings_are_page_locked_for_the_gpu() -> None:
    device = torch.device("cuda")
    pool, mappings = MemfdPool(device), PeerMappings(device)
    memfd = pool.take(1 << 20)
    try:
        assert memfd.locked_for == device
        assert torch.frombuffer(memfd.memory, dtype=torch.uint8).is_pinned()
        mapping = mappings.acquire(os.getpid(), memfd.fd, 1 << 20)
        assert mapping.locked_for == device  # read-only, and locked
        assert torch.frombuffer(mapping.memory, dtype=torch.uint8).is_pinned()
        mappings.release(mapping)
    finally:
        mappings.close()
        memfd.close()


@CUDA
def test_a_refused_page_lock_leaves_no_error_behind() -> None:
    device = torch.device("cuda")
    memory = mmap.mmap(-1, 1 << 20, prot=mmap.PROT_READ)
    address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    # A read-only mapping locked as writable: the driver refuses.
    assert not page_lock(address, len(memory), device)
    assert torch.ones(4, device=device).sum().item() == 4  # the next kernel runs
