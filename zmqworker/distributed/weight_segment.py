"""Shared memory that carries a weight update's bytes from the engine's process to its
workers on the same host: the engine writes a chunk of tensors into a segment and sends
a SharedWeights message that says where each piece lies; every worker maps the segment
and copies its own slices out.

A segment is an anonymous memfd, never named in /dev/shm: the kernel frees it with the
last process that maps it, whichever dies and however (SIGKILL included), so nothing
can be left behind. The worker maps it through /proc/<engine pid>/fd/<fd> (same user,
same host) after checking the link's name, the seals, the size and the header:

    bytes 0-7 magic "zmqwwts1" | 8-15 generation (u64, native) | 16-23 nbytes | 24-63 zero
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import secrets

import torch

from messages import SharedWeightRef, SharedWeights, WeightSpec
from zmqworker.distributed.sealed_memfd import create_sealed, open_peer
from zmqworker.distributed.weight_group import TORCH_DTYPES

MEMFD_NAME = "zmqworker-weights"
MAGIC = int.from_bytes(b"zmqwwts1", "little")
HEADER_BYTES = 64
ALIGN = 64  # every piece starts at a multiple of this

# Process-wide, from a random start: (pid, fd, generation) never names two segments.
_generations = itertools.count(secrets.randbits(40) + 1)


class WeightSegmentError(ValueError):
    """A SharedWeights message that does not name valid pieces of a live segment."""


class WeightSegment:
    """The engine's end: a sealed memfd of `capacity` bytes after the header."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a weight segment needs a capacity >= 1, got {capacity}")
        self.generation = next(_generations)
        self.nbytes = HEADER_BYTES + capacity
        self.fd, mm = create_sealed(MEMFD_NAME, self.nbytes)
        header = memoryview(mm)[:HEADER_BYTES].cast("Q")
        header[0], header[1], header[2] = MAGIC, self.generation, self.nbytes
        header.release()
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    def write(self, offset: int, rows: torch.Tensor) -> None:
        """Copy rows (a CPU tensor) to offset, in C order."""
        view = self.bytes[offset : offset + rows.nbytes].view(rows.dtype).view(rows.shape)
        view.copy_(rows)

    def descriptor(self, refs: list[SharedWeightRef]) -> SharedWeights:
        return SharedWeights(
            pid=os.getpid(),
            fd=self.fd,
            generation=self.generation,
            nbytes=self.nbytes,
            tensors=refs,
        )

    def close(self) -> None:
        """Close the fd; the memory goes with the last mapping (a worker's included)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.bytes = torch.empty(0, dtype=torch.uint8)


class MappedSegment:
    """A worker's view of one engine segment, checked before anything is read."""

    def __init__(self, shared: SharedWeights) -> None:
        path = f"/proc/{shared.pid}/fd/{shared.fd}"
        try:
            fd, size = open_peer(
                shared.pid, shared.fd, MEMFD_NAME, WeightSegmentError, "weight segment"
            )
        except OSError as e:
            raise RuntimeError(
                f"cannot open the engine's shared memory {path} ({e}): an update from the "
                "engine's process needs its workers on the same host; from elsewhere, send "
                "it through a weight-transfer group (init_weight_transfer_group)"
            ) from None
        try:
            if not HEADER_BYTES <= shared.nbytes <= size:
                raise WeightSegmentError(
                    f"a segment of {shared.nbytes} bytes: the file holds {size}"
                )
            mm = mmap.mmap(fd, shared.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        header = memoryview(mm)[:HEADER_BYTES].cast("Q")
        magic, generation, nbytes = header[0], header[1], header[2]
        header.release()
        if (magic, generation, nbytes) != (MAGIC, shared.generation, shared.nbytes):
            raise WeightSegmentError(
                f"{path} holds no weight segment of generation {shared.generation}"
            )
        self.nbytes = shared.nbytes
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    def piece(self, ref: SharedWeightRef, spec: WeightSpec) -> torch.Tensor:
        """The rows ref names of the announced tensor spec, in place (no copy)."""
        dtype = TORCH_DTYPES[spec.dtype]
        rows = spec.shape[0]
        if ref.row_start + ref.num_rows > rows:
            raise WeightSegmentError(
                f"tensor {ref.name}: rows {ref.row_start}..{ref.row_start + ref.num_rows} "
                f"of its {rows}"
            )
        shape = [ref.num_rows, *spec.shape[1:]]
        nbytes = math.prod(shape) * dtype.itemsize
        if ref.offset % ALIGN or not HEADER_BYTES <= ref.offset <= self.nbytes - nbytes:
            raise WeightSegmentError(
                f"tensor {ref.name}: {nbytes} bytes at offset {ref.offset} do not lie "
                f"{ALIGN}-byte aligned inside the segment's {self.nbytes} bytes"
            )
        return self.bytes[ref.offset : ref.offset + nbytes].view(dtype).view(shape)
