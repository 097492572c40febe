"""Where a producer stages KV, and where a consumer maps it: sealed memfds, reused.

A fresh memfd costs a page fault for every page its first writer touches (about as
long as the copy itself), and a fresh mapping of a peer's memfd a page walk: so the
producer keeps the memfds its pullers are done with (KVDone: nothing reads them any
more) for the next stagings, and a consumer keeps its mappings of a producer's memfds,
known by (pid, inode), for the next pulls. Expired staged KV is never reused: a late
puller may still read it.

Where the cache is on a GPU, each side page-locks its memfds and mappings once, when it
makes them (page_lock.py): the staging's copy out of the device and the pull's copy into
it then go by DMA, several times faster than through pageable memory. A mapping is
unlocked and unmapped only once no copy reads it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from zmqworker.distributed.page_lock import page_lock, page_unlock
from zmqworker.distributed.sealed_memfd import create_sealed, open_peer

MEMFD_NAME = "zmqworker-kv"
MAX_KEPT = 8  # memfds (or unused mappings) kept for reuse, each as large as a staging needed


def _address(memory: mmap.mmap) -> int:
    return np.frombuffer(memory, np.uint8).ctypes.data


@dataclass
class Memfd:
    """A producer's sealed memfd and its mapping (page-locked for locked_for, if not None)."""

    fd: int
    memory: mmap.mmap
    locked_for: torch.device | None = None

    def close(self) -> None:
        if self.locked_for is not None:
            page_unlock(_address(self.memory), self.locked_for)
            self.locked_for = None
        os.close(self.fd)
        # A zero-copy send may still hold the mapping: it goes with its last reference.
        with contextlib.suppress(BufferError):
            self.memory.close()


class MemfdPool:
    """The producer's memfds, free for reuse; thread-safe (staging on the worker's
    thread, giving back on the server's). device: a GPU to page-lock them for, or None."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self._free: list[Memfd] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Memfd:
        """A memfd of at least nbytes (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, m in enumerate(self._free) if len(m.memory) >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i].memory)))
        memfd = Memfd(*create_sealed(MEMFD_NAME, max(nbytes, 1)))
        try:
            if self._device is not None and page_lock(
                _address(memfd.memory), len(memfd.memory), self._device
            ):
                memfd.locked_for = self._device
        except BaseException:
            memfd.close()
            raise
        return memfd

    def give_back(self, memfd: Memfd) -> None:
        """Keep memfd for the next stagings; past MAX_KEPT the one given back longest ago
        goes (a large memfd in use keeps coming back, while many small ones from a burst
        of short prompts would otherwise fill the pool and leave every large staging to
        make, fault in and page-lock a fresh one)."""
        with self._lock:
            self._free.append(memfd)
            oldest = self._free.pop(0) if len(self._free) > MAX_KEPT else None
        if oldest is not None:
            oldest.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for memfd in free:
            memfd.close()


class SharedMemoryError(RuntimeError):
    pass


@dataclass
class PeerMapping:
    """A read-only mapping of a producer's memfd, and the arrivals reading it."""

    key: tuple[int, int]  # (pid, inode)
    memory: mmap.mmap
    locked_for: torch.device | None = None
    users: int = 0


class PeerMappings:
    """A consumer's mappings of producers' memfds: acquired on one thread (the puller's),
    released on any (the worker's, once its copy is done). The mappings no arrival
    reads are kept, the most recent MAX_KEPT. device: a GPU to page-lock them for, or
    None."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device
        self._maps: OrderedDict[tuple[int, int], PeerMapping] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, pid: int, peer_fd: int, nbytes: int, inode: int = 0) -> PeerMapping:
        """The peer's memfd, mapped (at least nbytes long), held until release(); OSError
        or SharedMemoryError where it cannot be, ValueError where the fd is now another
        memfd than inode (0: unchecked)."""
        fd, size = open_peer(pid, peer_fd, MEMFD_NAME, SharedMemoryError, "KV memfd",
                             inode=inode)  # fmt: skip
        try:
            key = (pid, inode or os.fstat(fd).st_ino)
            if size < nbytes:
                raise SharedMemoryError(f"the peer's memfd holds {size} bytes, {nbytes} needed")
            with self._lock:
                # A memfd is sealed against resizing, and a mapping keeps its inode from
                # reuse: one (pid, inode) is one memfd of one size.
                mapping = self._maps.get(key)
                if mapping is not None:
                    mapping.users += 1
                    self._maps.move_to_end(key)
                    return mapping
            # Populated at once: one walk of the pages, not a fault per page.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            memory = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mapping = PeerMapping(key, memory, users=1)
        if self._device is not None and page_lock(
            _address(memory), size, self._device, read_only=True
        ):
            mapping.locked_for = self._device
        with self._lock:
            self._maps[key] = mapping
            gone = self._unused_beyond_kept()
        for old in gone:
            _unmap(old)
        return mapping

    def release(self, mapping: PeerMapping) -> None:
        """An arrival is done reading mapping (its copies finished)."""
        with self._lock:
            mapping.users -= 1
            gone = self._unused_beyond_kept()
            if mapping.users == 0 and self._maps.get(mapping.key) is not mapping:
                gone.append(mapping)  # closed (close()) while it was read
        for old in gone:
            _unmap(old)

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mapping in maps:
            _unmap(mapping)

    def _unused_beyond_kept(self) -> list[PeerMapping]:
        """Take out the oldest mappings nobody reads while more than MAX_KEPT are kept."""
        gone = []
        unused = [k for k, m in self._maps.items() if m.users == 0]
        while len(self._maps) > MAX_KEPT and unused:
            gone.append(self._maps.pop(unused.pop(0)))
        return gone


def _unmap(mapping: PeerMapping) -> None:
    if mapping.locked_for is not None:
        page_unlock(_address(mapping.memory), mapping.locked_for)
        mapping.locked_for = None
    with contextlib.suppress(BufferError):  # a view outlives its arrival: goes with it
        mapping.memory.close()
