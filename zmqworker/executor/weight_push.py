"""The engine's end of a weight update from its own process (docs/protocol.md, "Weight
updates"): announce the update to every worker (start_weight_update: checked whole,
nothing changes on a refusal), send its bytes in chunks (load_weight_chunk), end it
(finish_weight_update; abort_weight_update when the engine cannot finish).

CPU tensors go through shared memory: two segments of chunk_bytes, filled in turn, so
that the engine fills one while the workers copy out of the other; a tensor larger than
a chunk goes in pieces of whole rows. The segments are made at the first such update and
kept for the next ones (their pages are then already mapped) until close(). CUDA tensors
go as CUDA IPC handles, with no copy on this side: the workers copy from this process's
memory, which the caller's tensors keep alive until the update returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch

from messages import CudaWeights, SharedWeightRef
from zmqworker.distributed.cuda_ipc import CudaSharer
from zmqworker.distributed.weight_group import describe
from zmqworker.distributed.weight_segment import ALIGN, HEADER_BYTES, WeightSegment
from zmqworker.executor.abstract import Executor

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
CUDA_REFS_PER_CHUNK = 256  # keeps a message of handles small

# (name, tensor, first row, rows, offset in the segment)
Placed = tuple[str, torch.Tensor, int, int, int]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _row_bytes(t: torch.Tensor) -> int:
    return t.nbytes // t.shape[0] if t.dim() and t.shape[0] else t.nbytes


def plan_chunks(items: list[tuple[str, torch.Tensor]], capacity: int) -> Iterator[list[Placed]]:
    """The tensors' rows packed into chunks of at most capacity bytes, in order; a
    tensor that does not fit in what is left of a chunk is cut between rows."""
    chunk: list[Placed] = []
    used = 0
    for name, t in items:
        rows, row_bytes = (t.shape[0] if t.dim() else 1), _row_bytes(t)
        start = 0
        while start < rows:
            fit = (capacity - used) // row_bytes if row_bytes else rows
            if fit == 0:
                yield chunk
                chunk, used = [], 0
                continue
            n = min(fit, rows - start)
            chunk.append((name, t, start, n, HEADER_BYTES + used))
            used += _aligned(n * row_bytes)
            start += n
    if chunk:
        yield chunk


class WeightPusher:
    """Pushes updates to an executor's workers. Not thread-safe: the engine's loop."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._segments: list[WeightSegment] = []

    @torch.no_grad()
    def push(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> None:
        """Every (name, tensor) pair into the workers' weights, or an error before any
        weight changes (an unknown name, a wrong shape or dtype)."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        items = [(name, _checked(name, t)) for name, t in weights]
        update = describe(items)
        call = self.executor.collective_rpc
        call("start_weight_update", (update,), timeout=timeout)
        try:
            host = [(n, t) for n, t in items if t.device.type == "cpu"]
            if host:
                self._push_shared(host, chunk_bytes, timeout)
            cuda = [(n, t) for n, t in items if t.device.type == "cuda"]
            sharer = CudaSharer()
            for start in range(0, len(cuda), CUDA_REFS_PER_CHUNK):
                refs = [sharer.ref(n, t) for n, t in cuda[start : start + CUDA_REFS_PER_CHUNK]]
                call("load_weight_chunk", (CudaWeights(refs),), timeout=timeout)
        except BaseException:
            try:
                call("abort_weight_update", timeout=timeout)
            except Exception:
                log.warning("abort_weight_update failed after a failed update", exc_info=True)
            raise
        call("finish_weight_update", timeout=timeout)

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []

    def _push_shared(
        self, items: list[tuple[str, torch.Tensor]], chunk_bytes: int, timeout: float | None
    ) -> None:
        capacity = max(chunk_bytes, *(_aligned(_row_bytes(t)) for _, t in items))
        if not self._segments or self._segments[0].nbytes < HEADER_BYTES + capacity:
            self.close()
            self._segments = [WeightSegment(capacity), WeightSegment(capacity)]
        in_flight: list[Future | None] = [None, None]
        try:
            for k, chunk in enumerate(plan_chunks(items, capacity)):
                turn = k % 2
                if in_flight[turn] is not None:
                    in_flight[turn].result()  # the workers are done with this segment
                    in_flight[turn] = None
                segment = self._segments[turn]
                refs = []
                for name, t, start, rows, offset in chunk:
                    segment.write(offset, t.narrow(0, start, rows) if t.dim() else t)
                    refs.append(SharedWeightRef(name, offset, start, rows))
                chunk_msg = segment.descriptor(refs)
                in_flight[turn] = self.executor.collective_rpc(
                    "load_weight_chunk", (chunk_msg,), timeout=timeout, non_block=True
                )
        finally:
            # No segment is written again before the workers are done with it.
            errors = []
            for future in in_flight:
                if future is not None:
                    try:
                        future.result()
                    except Exception as e:
                        errors.append(e)
            if errors:
                raise errors[0]


def _checked(name: object, t: object) -> torch.Tensor:
    if not isinstance(name, str):
        raise TypeError(f"a weight's name is a str, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weight {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight {name} is on {t.device}: updates come from the CPU or CUDA")
    return t.detach()
