"""A ring of shared-memory slots that carries a message's tensors between two processes
on one host with a single copy: the sender writes into a free slot, the receiver reads
the slot's memory in place and hands the slot back when it is done.

The memory is one anonymous `memfd` segment per sender, never named in /dev/shm: when
either process dies (SIGKILL included) the kernel frees it with the last mapping, so
there is nothing to leak or clean up. The receiver maps it through
/proc/<sender pid>/fd/<fd> (same user, same host) and closes its fd at once (Python's
mmap keeps a duplicate for as long as the mapping lives). A sender pins its segment for
CUDA when device tensors come, so that they are copied out of the GPU by DMA.

Segment layout (native-endian u64 words, then the slots):

    word 0 magic | 1 generation | 2 num_slots | 3 slot_size | 4 data_offset | 5-7 unused
    word 8 + i   slot i: (seq << 1) | full
    data_offset  slot 0, slot 1, ... (slot_size bytes each, 64-byte aligned)

A slot's word changes hands: the sender sets it full after its copies and before the
message that names the slot is sent; the receiver sets it free once the step that read
the slot is over. Each side writes it only while the slot is in its hands, so a plain
aligned 8-byte store is enough (x86-64 keeps stores in order).

torch is imported once a segment is made or mapped: every worker process holds a receiver
from its start, and a worker that runs no model (a stand-in) needs no torch.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import secrets
import time
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING

from messages import SharedSlot, SharedTensorRef
from messages.codec import DTYPE_NAMES, MAX_NDIM
from zmqworker.cdiv import cdiv
from zmqworker.distributed.sealed_memfd import create_sealed, open_peer

if TYPE_CHECKING:
    import torch

MEMFD_NAME = "zmqworker-pp"
MAGIC = int.from_bytes(b"zmqwshm1", "little")
HEADER_WORDS = 8  # words before the slot words
ALIGN = 64  # every tensor starts at a multiple of this
MIN_SLOT_BYTES = 1 << 20
SLOT_GRANULE = 64 << 10
MAX_SLOTS = 1024
FIRST_WAIT_S, LONGEST_WAIT_S = 20e-6, 1e-3  # polling for a free slot: never spin hard

# Process-wide and starting at a random value: (pid, fd, generation) never names two
# segments, even after an fd number or a pid is reused.
_generations = itertools.count(secrets.randbits(40) + 1)


class ShmDescriptorError(ValueError):
    """A descriptor that does not name valid tensors in a live ring segment."""


@cache
def _dtypes() -> dict[str, torch.dtype]:
    """The torch dtype of each wire dtype name."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


@cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _dtypes().items()}


def shm_available() -> bool:
    """Whether this platform has anonymous shared memory files (Linux)."""
    return hasattr(os, "memfd_create")


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def _full(seq: int) -> int:
    return (seq << 1) | 1


class _Segment:
    """The sender's memfd segment: its header words and its bytes as one uint8 tensor."""

    def __init__(self, num_slots: int, slot_size: int) -> None:
        self.generation = next(_generations)
        self.num_slots, self.slot_size = num_slots, slot_size
        self.data_offset = _round_up(8 * (HEADER_WORDS + num_slots), mmap.PAGESIZE)
        self.nbytes = self.data_offset + num_slots * slot_size
        self.fd, mm = create_sealed(MEMFD_NAME, self.nbytes)
        self.words = memoryview(mm)[: self.data_offset].cast("Q")
        layout = (MAGIC, self.generation, num_slots, slot_size, self.data_offset)
        for i, value in enumerate(layout):
            self.words[i] = value
        import torch

        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._pin_tried = False
        self.pinned_for: torch.device | None = None  # the device it is page-locked for

    def pin(self, device: torch.device) -> None:
        """Page-lock the segment for CUDA (once): device-to-host copies then land in it by
        DMA (page_lock.py). Where the driver refuses, the copies stay pageable."""
        if not self._pin_tried:
            self._pin_tried = True
            from zmqworker.distributed.page_lock import page_lock

            if page_lock(self.bytes.data_ptr(), self.nbytes, device):
                self.pinned_for = device

    def free_slot(self, start: int) -> int | None:
        for k in range(self.num_slots):
            i = (start + k) % self.num_slots
            if not self.words[HEADER_WORDS + i] & 1:
                return i
        return None

    def all_free(self) -> bool:
        return all(not self.words[HEADER_WORDS + i] & 1 for i in range(self.num_slots))

    def close(self) -> None:
        """Close the fd; the mapping goes with the last reference to it."""
        if self.pinned_for is not None:
            from zmqworker.distributed.page_lock import page_unlock

            page_unlock(self.bytes.data_ptr(), self.pinned_for)
        os.close(self.fd)
        del self.words, self.bytes


class ShmSender:
    """The writing end. Not thread-safe: one per sending thread."""

    def __init__(self, peer: str, num_slots: int = 4, timeout_s: float = 120.0) -> None:
        """peer: who reads the slots, for error messages. num_slots: more than the
        messages in flight. timeout_s: the longest put() waits for a free slot."""
        if not shm_available():
            raise RuntimeError("shared-memory rings need os.memfd_create (Linux)")
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be 1..{MAX_SLOTS}, not {num_slots}")
        self.peer = peer
        self.num_slots = num_slots
        self.timeout_s = timeout_s
        self._segment: _Segment | None = None
        # Outgrown segments stay open until the receiver has handed back every slot: it
        # may not have opened them yet, and their fd numbers must not name anything else.
        self._retired: list[_Segment] = []
        self._next = 0

    def put(self, tensors: Mapping[str, torch.Tensor]) -> SharedSlot:
        """Copy tensors (CPU or CUDA) into a free slot, waiting for one (bounded), and
        return what the receiver needs to find them."""
        import torch

        dtype_names = _dtype_names()
        for name, t in tensors.items():
            if t.dtype not in dtype_names:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot cross the pipeline")
        sizes = {name: _round_up(t.nbytes, ALIGN) for name, t in tensors.items()}
        needed = sum(sizes.values())
        self._close_retired()
        segment = self._segment
        if segment is None or needed > segment.slot_size:
            segment = self._grow(needed)
        devices = {t.device for t in tensors.values() if t.is_cuda}
        if devices:
            segment.pin(min(devices, key=str))
        slot = self._wait_for_slot(segment)
        seq = (segment.words[HEADER_WORDS + slot] >> 1) + 1
        offset = segment.data_offset + slot * segment.slot_size
        refs = []
        with torch.no_grad():
            for name, t in tensors.items():
                view = segment.bytes[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t, non_blocking=True)  # from a device: straight into the slot
                refs.append(SharedTensorRef(name, dtype_names[t.dtype], list(t.shape), offset))
                offset += sizes[name]
        for device in devices:  # the slot is full only once the copies are done
            torch.cuda.current_stream(device).synchronize()
        segment.words[HEADER_WORDS + slot] = _full(seq)
        self._next = slot + 1
        return SharedSlot(
            pid=os.getpid(),
            fd=segment.fd,
            generation=segment.generation,
            nbytes=segment.nbytes,
            slot=slot,
            seq=seq,
            tensors=refs,
        )

    def close(self) -> None:
        for segment in self._retired:
            segment.close()
        self._retired = []
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _grow(self, needed: int) -> _Segment:
        """A new generation whose slots fit needed bytes with headroom; at least double
        the old slots, so that a growing message makes few generations."""
        old = self._segment
        slot_size = max(needed + needed // 4, MIN_SLOT_BYTES, 2 * old.slot_size if old else 0)
        self._segment = _Segment(self.num_slots, _round_up(slot_size, SLOT_GRANULE))
        if old is not None:
            self._retired.append(old)
        self._next = 0
        return self._segment

    def _close_retired(self) -> None:
        still_held = []
        for segment in self._retired:
            if segment.all_free():
                segment.close()
            else:
                still_held.append(segment)
        self._retired = still_held

    def _wait_for_slot(self, segment: _Segment) -> int:
        slot = segment.free_slot(self._next)
        if slot is not None:
            return slot
        deadline = time.monotonic() + self.timeout_s
        delay = FIRST_WAIT_S
        while (slot := segment.free_slot(self._next)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.peer} has not released any of its {segment.num_slots} "
                    f"shared-memory slots within {self.timeout_s:g} s"
                )
            time.sleep(delay)
            delay = min(2 * delay, LONGEST_WAIT_S)
        return slot


class _Mapping:
    """The receiver's view of one sender segment, checked before anything is read."""

    def __init__(self, shared: SharedSlot) -> None:
        self.pid, self.fd, self.generation = shared.pid, shared.fd, shared.generation
        path = f"/proc/{shared.pid}/fd/{shared.fd}"
        fd, size = open_peer(shared.pid, shared.fd, MEMFD_NAME, ShmDescriptorError, "ring segment")
        try:
            if not 8 * HEADER_WORDS <= shared.nbytes <= size or shared.nbytes % 8:
                raise ShmDescriptorError(
                    f"segment of {shared.nbytes} bytes (whole words expected): the file holds "
                    f"{size}"
                )
            mm = mmap.mmap(fd, shared.nbytes)
        finally:
            os.close(fd)
        words = memoryview(mm).cast("Q")
        magic, generation, num_slots, slot_size, data_offset = words[:5]
        if magic != MAGIC or generation != shared.generation:
            raise ShmDescriptorError(
                f"{path} holds no ring segment of generation {shared.generation}"
            )
        layout_ok = (
            1 <= num_slots <= MAX_SLOTS
            and slot_size % ALIGN == 0
            and data_offset % ALIGN == 0
            and data_offset >= 8 * (HEADER_WORDS + num_slots)
            and data_offset + num_slots * slot_size <= shared.nbytes
        )
        if not layout_ok:
            raise ShmDescriptorError(
                f"segment layout ({num_slots} slots of {slot_size} bytes at {data_offset}) "
                f"does not fit its {shared.nbytes} bytes"
            )
        self.num_slots, self.slot_size, self.data_offset = num_slots, slot_size, data_offset
        self.words = words[: HEADER_WORDS + num_slots]
        import torch

        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    def views(self, shared: SharedSlot) -> dict[str, torch.Tensor]:
        if shared.slot >= self.num_slots:
            raise ShmDescriptorError(f"slot {shared.slot}: the segment has {self.num_slots}")
        if self.words[HEADER_WORDS + shared.slot] != _full(shared.seq):
            raise ShmDescriptorError(f"slot {shared.slot} does not hold use {shared.seq}")
        start = self.data_offset + shared.slot * self.slot_size
        return {ref.name: self._view(ref, start, start + self.slot_size) for ref in shared.tensors}

    def _view(self, ref: SharedTensorRef, start: int, end: int) -> torch.Tensor:
        dtype = _dtypes().get(ref.dtype)
        if dtype is None:
            raise ShmDescriptorError(f"tensor {ref.name!r}: unknown dtype {ref.dtype!r}")
        if len(ref.shape) > MAX_NDIM:
            raise ShmDescriptorError(f"tensor {ref.name!r}: {len(ref.shape)} dimensions")
        nbytes = math.prod(ref.shape) * dtype.itemsize
        if ref.offset % dtype.itemsize or not start <= ref.offset <= end - nbytes:
            raise ShmDescriptorError(
                f"tensor {ref.name!r}: {nbytes} bytes at offset {ref.offset} do not lie "
                f"aligned inside the slot's bytes {start}..{end}"
            )
        try:
            return self.bytes[ref.offset : ref.offset + nbytes].view(dtype).view(ref.shape)
        except (RuntimeError, TypeError) as e:  # dimensions torch cannot hold
            reason = str(e).splitlines()[0]
            raise ShmDescriptorError(f"tensor {ref.name!r}: shape {ref.shape}: {reason}") from None

    def release(self, slot: int, seq: int) -> None:
        if self.words[HEADER_WORDS + slot] == _full(seq):
            self.words[HEADER_WORDS + slot] = seq << 1


class ShmLease:
    """A received message's tensors: views on the sender's slot, valid until release()."""

    def __init__(self, mapping: _Mapping, slot: int, seq: int, tensors: dict) -> None:
        self.tensors: dict[str, torch.Tensor] = tensors
        self._mapping: _Mapping | None = mapping
        self._slot, self._seq = slot, seq

    def release(self) -> None:
        """Give the slot back to the sender (once; a second call does nothing). The views
        stay readable, but the sender may overwrite them from now on."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.release(self._slot, self._seq)


class ShmReceiver:
    """The reading end: maps senders' segments on first use, one (the newest) per
    sender process. Not thread-safe for open(); a lease may be released anywhere."""

    def __init__(self) -> None:
        self._mappings: dict[int, _Mapping] = {}

    def open(self, shared: SharedSlot) -> ShmLease:
        """The tensors shared names, zero-copy. Raises ShmDescriptorError for a
        descriptor that names no valid tensors, OSError when the sender's segment
        cannot be opened (gone, or another user's)."""
        mapping = self._mappings.get(shared.pid)
        if mapping is None or (mapping.fd, mapping.generation) != (shared.fd, shared.generation):
            # An older generation's memory lives on in the views (and leases) made on it.
            mapping = _Mapping(shared)
            self._mappings[shared.pid] = mapping
        return ShmLease(mapping, shared.slot, shared.seq, mapping.views(shared))

    def close(self) -> None:
        """Forget the mappings; memory still viewed stays mapped until its views go."""
        self._mappings.clear()
