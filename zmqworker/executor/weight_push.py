"""The engine's end of a weight update from its own process (docs/protocol.md, "Weight
updates"): announce the update to every worker (start_weight_update: checked whole,
nothing changes on a refusal), send its bytes in chunks (load_weight_chunk), end it
(finish_weight_update). When the engine cannot send it all, finish_weight_update ends it
too, as the workers' verdict: it refuses the update, and a worker whose weights may have
changed (or that failed a chunk the others may have taken) says so (PartialLoadError),
which the engine core keeps to refuse requests until a complete update or a reload;
abort_weight_update only where that call itself fails.

CPU tensors go through shared memory: two segments of chunk_bytes, filled in turn, so
that the engine fills one while the workers copy out of the other; a tensor larger than
a chunk goes in pieces of whole rows (each piece at a multiple of ALIGN; a chunk holds at
least one row of the widest tensor, whatever chunk_bytes says). The segments are made at
the first such update and kept for the next ones (their pages are then already mapped)
until close(). CUDA tensors go as CUDA IPC handles, with no copy on this side: the
workers copy from this process's memory, which the caller's tensors keep alive until the
update returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

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


def chunk_capacity(items: list[tuple[str, torch.Tensor]], chunk_bytes: int) -> int:
    """The bytes of a chunk past its header: chunk_bytes rounded down to ALIGN, or one
    row of the widest tensor (aligned) if that is more."""
    widest = max((_aligned(_row_bytes(t)) for _, t in items), default=ALIGN)
    return max(chunk_bytes - chunk_bytes % ALIGN, widest, ALIGN)


def plan_chunks(items: list[tuple[str, torch.Tensor]], capacity: int) -> Iterator[list[Placed]]:
    """The tensors' rows packed into chunks of at most capacity bytes, in order, each
    piece at a multiple of ALIGN; a tensor that does not fit in what is left of a chunk
    is cut between rows. Every row lies in exactly one piece."""
    capacity -= capacity % ALIGN  # pieces start aligned: so do their ends, and fit
    for name, t in items:
        if _aligned(_row_bytes(t)) > capacity:
            raise ValueError(
                f"a chunk of {capacity} bytes cannot hold a row of {name} "
                f"({_row_bytes(t)} bytes): chunk_bytes must be at least that"
            )
    chunk: list[Placed] = []
    used = 0  # a multiple of ALIGN, at most capacity
    for name, t in items:
        rows, row_bytes = (t.shape[0] if t.dim() else 1), _row_bytes(t)
        start = 0
        while start < rows:
            fit = (capacity - used) // row_bytes if row_bytes else rows - start
            if fit <= 0:  # full (a row fits an empty chunk: checked above)
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
            _end_failed(call, timeout)
            raise
        call("finish_weight_update", timeout=timeout)

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []

    def _push_shared(
        self, items: list[tuple[str, torch.Tensor]], chunk_bytes: int, timeout: float | None
    ) -> None:
        capacity = chunk_capacity(items, chunk_bytes)
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


def _end_failed(call: Callable[..., Any], timeout: float | None) -> None:
    """End an update that failed on the way on every worker, the workers judging what it
    left (see the module's docstring); the failure itself is what the caller sees."""
    try:
        call("finish_weight_update", timeout=timeout)
        return  # every row had come after all: the update is whole
    except (ValueError, RuntimeError) as e:  # the verdict: refused, its reason kept
        log.debug("a failed update ended: %s", e)
        return
    except Exception:
        log.warning("finish_weight_update failed after a failed update", exc_info=True)
    try:
        call("abort_weight_update", timeout=timeout)
    except Exception:
        log.warning("abort_weight_update failed after a failed update", exc_info=True)


def _checked(name: object, t: object) -> torch.Tensor:
    if not isinstance(name, str):
        raise TypeError(f"a weight's name is a str, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"weight {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight {name} is on {t.device}: updates come from the CPU or CUDA")
    return t.detach()
