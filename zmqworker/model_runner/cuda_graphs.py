"""Decode steps replayed from CUDA graphs: one launch instead of about ten per layer.

A graph is captured per batch size, over the runner's persistent buffers (DeviceInputs:
input ids, positions, slot mapping, block tables, sequence lengths; the previous stage's
hidden states on later pipeline stages). A decode step of n requests is written into
those buffers padded to the smallest captured size >= n and replays that graph; padding
rows attend nothing and write no KV. Each graph copies its results into one set of
static output buffers, sized for the largest graph, so that the graphs, captured largest
first into one memory pool, hold one step's activations between them.

Capture is a parameter: torch's CUDA graphs on a GPU; tests on the CPU pass a recorder
that replays the captured function, which exercises the same buffers and padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# vLLM's schedule: every size up to 4, then multiples of 8.
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None]], Replayable]
Body = Callable[[int], dict[str, torch.Tensor]]


def default_graph_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to limit, and limit itself."""
    sizes = [s for s in _SMALL_SIZES if s <= limit]
    sizes += list(range(_SIZE_STEP, limit + 1, _SIZE_STEP))
    if limit not in sizes:
        sizes.append(limit)
    return sizes


def capture_cuda_graph(pool: tuple[int, int], stream: torch.cuda.Stream) -> Capture:
    """Capture into torch.cuda.CUDAGraph objects sharing one memory pool, on the stream
    the warm-up ran on. thread_local: the worker's health-check thread may touch the
    device while a graph is being captured."""

    def capture(fn: Callable[[], None]) -> Replayable:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            fn()
        return graph

    return capture


class DecodeGraphs:
    """body(size) runs a decode step of `size` rows over the persistent buffers and
    returns its outputs by name, each [size, ...]; it is what a graph records, so it
    launches device work only. idle(size) fills the buffers with a step of `size` rows
    that attends nothing and writes nothing, to warm up and capture over."""

    def __init__(
        self,
        sizes: list[int],
        body: Body,
        idle: Callable[[int], None],
        capture: Capture | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph sizes must be >= 1, got {sizes}")
        self.sizes = sorted(set(sizes))
        self._body = body
        self._idle = idle
        self._capture = capture
        self._graphs: dict[int, Replayable] = {}
        self._outputs: dict[str, torch.Tensor] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture_all(self) -> None:
        """Run each size once eagerly (compiles its kernels), then capture it; largest
        first, so that the smaller graphs reuse the largest one's memory."""
        self.release()
        if self._capture is not None:
            self._capture_sizes(self._capture)
            return
        # Warm-up and capture on one side stream, as CUDA graphs want.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._capture_sizes(capture_cuda_graph(torch.cuda.graph_pool_handle(), stream))
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_sizes(self, capture: Capture) -> None:
        for size in reversed(self.sizes):
            self._idle(size)
            warm = self._body(size)
            if not self._outputs:
                top = self.sizes[-1]
                self._outputs = {
                    name: torch.empty((top, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for name, t in warm.items()
                }
            del warm
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self._graphs[size] = capture(lambda size=size: self._run_into_outputs(size))

    def size_for(self, num_reqs: int) -> int | None:
        """The captured size a step of num_reqs decodes replays, or None (run eagerly)."""
        if not self._graphs or num_reqs > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def replay(self, size: int) -> dict[str, torch.Tensor]:
        """Replay the graph of `size`; its outputs are views that the next replay reuses."""
        self._graphs[size].replay()
        return {name: buf[:size] for name, buf in self._outputs.items()}

    def release(self) -> None:
        """Drop the graphs and their memory (sleep, a new KV cache, shutdown)."""
        self._graphs.clear()
        self._outputs = {}

    def _run_into_outputs(self, size: int) -> None:
        for name, tensor in self._body(size).items():
            self._outputs[name][:size].copy_(tensor)
