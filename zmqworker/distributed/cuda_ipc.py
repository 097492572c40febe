"""CUDA tensors of the engine's process, opened by its workers on the same host through
CUDA IPC: no copy on the engine's side, one device copy into each worker's slices.

The engine shares each distinct storage once (torch's `_share_cuda_`, which also keeps
the memory from being reused until every opener has let it go) and describes each
tensor by that storage's handles and its place in it; refs of one storage repeat the
same handles, and a worker opens each distinct one once. A GPU is named by its UUID:
the engine's device index and a worker's (under its CUDA_VISIBLE_DEVICES) may differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from messages import CudaWeightRef, WeightSpec
from zmqworker.distributed.weight_group import TORCH_DTYPES


def device_uuid(index: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class CudaSharer:
    """The engine's end: refs for tensors, sharing each storage once."""

    def __init__(self) -> None:
        self._shared: dict[tuple[int, int], tuple] = {}

    def ref(self, name: str, tensor: torch.Tensor) -> CudaWeightRef:
        storage = tensor.untyped_storage()
        key = (tensor.device.index or 0, storage.data_ptr())
        if key not in self._shared:
            self._shared[key] = storage._share_cuda_()
        device, handle, size, offset, counter, counter_offset, event, sync = self._shared[key]
        return CudaWeightRef(
            name=name,
            device_uuid=device_uuid(device),
            handle=handle,
            storage_size_bytes=size,
            storage_offset_bytes=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event or b"",
            event_sync_required=bool(sync),
            stride=list(tensor.stride()),
            storage_offset=tensor.storage_offset(),
        )


class CudaOpener:
    """A worker's end for one chunk: the tensors refs name, each distinct storage opened
    once. Its tensors are dropped inside releasing(), once their copies are done."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA tensors were sent to a worker without a CUDA device")
        self._indices = {device_uuid(i): i for i in range(torch.cuda.device_count())}
        self._storages: dict[tuple[bytes, int], torch.UntypedStorage] = {}

    def tensor(self, ref: CudaWeightRef, spec: WeightSpec) -> torch.Tensor:
        index = self._indices.get(ref.device_uuid)
        if index is None:
            raise RuntimeError(
                f"tensor {ref.name} lies on {ref.device_uuid}, which this worker cannot see "
                f"(its GPUs: {sorted(self._indices)}; see CUDA_VISIBLE_DEVICES)"
            )
        dtype = TORCH_DTYPES[spec.dtype]
        if len(ref.stride) != len(spec.shape):
            raise ValueError(f"tensor {ref.name}: {len(ref.stride)} strides for {spec.shape}")
        span = 1 + sum((n - 1) * s for n, s in zip(spec.shape, ref.stride, strict=True))
        if math.prod(spec.shape) and (ref.storage_offset + span) * dtype.itemsize > (
            ref.storage_size_bytes
        ):
            raise ValueError(
                f"tensor {ref.name}: shape {spec.shape} at stride {ref.stride} from element "
                f"{ref.storage_offset} reaches past its storage of {ref.storage_size_bytes} bytes"
            )
        key = (ref.handle, ref.storage_offset_bytes)
        storage = self._storages.get(key)
        if storage is None:
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                ref.handle,
                ref.storage_size_bytes,
                ref.storage_offset_bytes,
                ref.ref_counter_handle,
                ref.ref_counter_offset,
                ref.event_handle,
                ref.event_sync_required,
            )
            self._storages[key] = storage
        out = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
        return out.set_(storage, ref.storage_offset, spec.shape, ref.stride)

    @contextmanager
    def releasing(self) -> Iterator[None]:
        """Drop the tensors made from the storages inside this; the storages go at its
        end. torch's deleter of an opened storage synchronizes the current stream before
        it hands the memory back; after the copies' event that waits for nothing, so a
        sync-debug mode set to catch real waits is lifted for the release."""
        with _sync_debug_lifted():
            try:
                yield
            finally:
                self._storages.clear()


@contextmanager
def _sync_debug_lifted() -> Iterator[None]:
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
