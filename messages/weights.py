"""Live weight updates: an update's announcement, and its bytes in shared memory or in
CUDA memory of the engine's process (docs/protocol.md, "Weight updates").

An update is announced whole (WeightUpdate: every tensor's name, dtype and shape) and
checked by every worker before any weight changes; its bytes then come in chunks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WeightSpec(msgspec.Struct, tag=True):
    """One tensor of an update: its Hugging Face checkpoint name, its dtype (a codec
    dtype name, e.g. "bfloat16") and its full shape (the whole tensor, not a shard)."""

    name: str
    dtype: str
    shape: list[NonNegative]


class WeightUpdate(msgspec.Struct, tag=True):
    """The announcement of an update: every tensor it will carry, in the order it will
    carry them. piece_bytes: through a weight-transfer group, the trainer broadcasts
    each tensor in pieces of whole rows (dim 0) of at most this many bytes (a row
    larger than that is a piece alone); 0: whole tensors."""

    tensors: list[WeightSpec]
    piece_bytes: NonNegative = 0


class SharedWeightRef(msgspec.Struct, tag=True):
    """Rows [row_start, row_start + num_rows) along dim 0 of announced tensor `name`
    (all of it, when it is 1-D and whole), C order in the announced dtype, starting
    offset bytes from the segment's start."""

    name: str
    offset: NonNegative
    row_start: NonNegative
    num_rows: NonNegative


class SharedWeights(msgspec.Struct, tag=True):
    """A chunk of an update in shared memory on the engine's host: the anonymous memory
    (memfd) segment that process `pid` holds open as file descriptor `fd`, of nbytes
    bytes; generation names the segment (its header repeats it)."""

    pid: Annotated[int, msgspec.Meta(ge=1)]
    fd: NonNegative
    generation: NonNegative
    nbytes: NonNegative
    tensors: list[SharedWeightRef]


class CudaWeightRef(msgspec.Struct, tag=True):
    """One announced tensor, whole, in CUDA memory of a process on the same host: what
    torch's `UntypedStorage._share_cuda_()` gives for its storage (the IPC handles),
    and the tensor's place in that storage (in elements). device_uuid names the GPU
    (e.g. "GPU-5f2c..."), whatever index it has in either process."""

    name: str
    device_uuid: str
    handle: bytes
    storage_size_bytes: NonNegative
    storage_offset_bytes: NonNegative
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes
    event_sync_required: bool
    stride: list[NonNegative]
    storage_offset: NonNegative


class CudaWeights(msgspec.Struct, tag=True):
    """A chunk of an update in the engine process's CUDA memory."""

    tensors: list[CudaWeightRef]
