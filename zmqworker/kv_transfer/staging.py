"""Where a producer stages KV, and where a consumer maps it: sealed memfds, reused.

A fresh memfd costs a page fault for every page its first writer touches (about as
long as the copy itself), and a fresh mapping of a peer's memfd a page walk: so the
producer keeps the memfds its pullers are done with (KVDone: nothing reads them any
more) for the next stagings, and a consumer keeps its mappings of a producer's memfds,
known by (pid, inode), for the next pulls. Expired staged KV is never reused: a late
puller may still read it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict

from zmqworker.distributed.sealed_memfd import create_sealed, open_peer

MEMFD_NAME = "zmqworker-kv"
MAX_KEPT = 8  # memfds (or mappings) kept for reuse, each as large as a staging needed


class MemfdPool:
    """The producer's memfds, free for reuse; thread-safe (staging on the worker's
    thread, giving back on the server's)."""

    def __init__(self) -> None:
        self._free: list[tuple[int, mmap.mmap]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, mmap.mmap]:
        """A memfd of at least nbytes (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, (_, m) in enumerate(self._free) if len(m) >= nbytes]
            if fits:
                best = min(fits, key=lambda i: len(self._free[i][1]))
                return self._free.pop(best)
        return create_sealed(MEMFD_NAME, max(nbytes, 1))

    def give_back(self, fd: int, memory: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < MAX_KEPT:
                self._free.append((fd, memory))
                return
        close_memfd(fd, memory)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for fd, memory in free:
            close_memfd(fd, memory)


def close_memfd(fd: int, memory: mmap.mmap) -> None:
    os.close(fd)
    # A zero-copy send may still hold the mapping: it goes with its last reference.
    with contextlib.suppress(BufferError):
        memory.close()


class SharedMemoryError(RuntimeError):
    pass


class PeerMappings:
    """A consumer's read-only mappings of producers' memfds, the most recent kept."""

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()

    def map(self, pid: int, peer_fd: int, nbytes: int) -> mmap.mmap:
        """The peer's memfd, mapped (at least nbytes long); OSError or SharedMemoryError
        where it cannot be."""
        fd, size = open_peer(pid, peer_fd, MEMFD_NAME, SharedMemoryError, "KV memfd")
        try:
            if size < nbytes:
                raise SharedMemoryError(f"the peer's memfd holds {size} bytes, {nbytes} needed")
            key = (pid, os.fstat(fd).st_ino)
            memory = self._maps.get(key)
            if memory is not None and len(memory) == size:
                self._maps.move_to_end(key)
                return memory
            # Populated at once: one walk of the pages, not a fault per page.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            memory = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[key] = memory
        while len(self._maps) > MAX_KEPT:
            _, old = self._maps.popitem(last=False)
            with contextlib.suppress(BufferError):  # still read: goes with its last view
                old.close()
        return memory

    def close(self) -> None:
        for memory in self._maps.values():
            with contextlib.suppress(BufferError):
                memory.close()
        self._maps.clear()
