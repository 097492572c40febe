"""Steps replayed from CUDA graphs: one launch instead of about ten per layer.

Two sets of graphs, both over the runner's persistent buffers (DeviceInputs: input ids,
positions, slot mapping, block tables, sequence lengths, query starts; the previous
stage's hidden states on later pipeline stages):

- decode graphs, one per batch size (default_graph_sizes): a decode step of n requests
  is written padded to the smallest captured size >= n; padding rows attend nothing and
  write no KV;
- token graphs, one per token count (default_token_sizes) up to max_num_batched_tokens,
  for every other step (prefills, chunks over a cached prefix, mixed steps): a step of t
  tokens is padded to the smallest captured count >= t, its padding tokens held by a
  padding request of no history, so that they attend nothing, write no KV and are not
  sampled. The request count of a token graph is fixed too (token_graph_reqs): the
  attention's grid and the logits' rows depend on it.

Each graph copies its results into one set of static output buffers shared by both sets,
sized by the largest graph (captured first), so that the graphs, captured largest first
into one memory pool, hold one step's activations between them.

Capture is a parameter: torch's CUDA graphs on a GPU; tests on the CPU pass a recorder
that replays the captured function, which exercises the same buffers and padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

# vLLM's schedule: every size up to 4, then multiples of 8.
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8
# Token graphs: multiples of 16 up to 128, then 8 counts a doubling, so padding adds at
# most an eighth to a step's tokens (an eighth of its matmul time where that rules).
_TOKEN_STEP = 16
_TOKEN_FINE_UP_TO = 128
_TOKEN_COUNTS_PER_DOUBLING = 8


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None]], Replayable]
Body = Callable[[int], dict[str, torch.Tensor]]


def default_graph_sizes(limit: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, 8, 16, 24, ... up to limit, and limit itself."""
    sizes = [s for s in _SMALL_SIZES if s <= limit]
    sizes += list(range(_SIZE_STEP, limit + 1, _SIZE_STEP))
    if limit not in sizes:
        sizes.append(limit)
    return sizes


def default_token_sizes(limit: int) -> list[int]:
    """Token counts: 16, 32, ..., 128, then 144, 160, ... 256, 288, ... (eight a
    doubling) up to limit, and limit itself; none below 2 (a step of one token is a
    decode)."""
    sizes = list(range(_TOKEN_STEP, min(limit, _TOKEN_FINE_UP_TO) + 1, _TOKEN_STEP))
    size = _TOKEN_FINE_UP_TO
    while size < limit:
        doubling = 1 << (size.bit_length() - 1)  # the power of two at or below size
        size += max(_TOKEN_STEP, doubling // _TOKEN_COUNTS_PER_DOUBLING)
        if size < limit:
            sizes.append(size)
    if limit >= 2 and limit not in sizes:
        sizes.append(limit)
    return sizes


def token_graph_reqs(num_tokens: int, max_num_reqs: int) -> int:
    """The request slots of the token graph of num_tokens: any step it takes (at most
    max_num_reqs requests, fewer than num_tokens unless every request has one token)
    and one slot more for the padding request."""
    return min(max_num_reqs, num_tokens - 1) + 1


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


class StepGraphs:
    """One set of graphs, by size. body(size) runs a step of that size over the
    persistent buffers and returns its outputs by name, each [rows, ...] (rows may
    differ from size); it is what a graph records, so it launches device work only.
    idle(size) fills the buffers with a step of that size that attends nothing and
    writes nothing, to warm up and capture over. outputs: the static output buffers,
    shared with the other set; the largest graph captured allocates them."""

    def __init__(
        self,
        kind: str,
        sizes: list[int],
        body: Body,
        idle: Callable[[int], None],
        outputs: dict[str, torch.Tensor],
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"CUDA graph sizes must be >= 1, got {sizes}")
        self.kind = kind
        self.sizes = sorted(set(sizes))
        self._body = body
        self._idle = idle
        self._outputs = outputs
        self._graphs: dict[int, Replayable] = {}
        self._rows: dict[int, dict[str, int]] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, capture: Capture) -> None:
        """Run each size once eagerly (compiles its kernels), then capture it; largest
        first, so that the smaller graphs reuse the largest one's memory."""
        for size in reversed(self.sizes):
            self._idle(size)
            warm = self._body(size)
            for name, tensor in warm.items():
                buf = self._outputs.get(name)
                if buf is None:
                    self._outputs[name] = torch.empty_like(tensor)
                elif buf.shape[0] < tensor.shape[0] or buf.shape[1:] != tensor.shape[1:]:
                    raise RuntimeError(
                        f"{self.kind} graph of {size}: output {name} {tuple(tensor.shape)} "
                        f"outgrows the static buffer {tuple(buf.shape)} (capture the "
                        "largest graphs first)"
                    )
            self._rows[size] = {name: t.shape[0] for name, t in warm.items()}
            del warm
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self._graphs[size] = capture(lambda size=size: self._run_into_outputs(size))

    def size_for(self, n: int) -> int | None:
        """The captured size a step of n (requests or tokens) replays, or None (eager)."""
        if not self._graphs or n > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= n)

    def replay(self, size: int) -> dict[str, torch.Tensor]:
        """Replay the graph of `size`; its outputs are views that the next replay reuses."""
        self._graphs[size].replay()
        return {name: self._outputs[name][:rows] for name, rows in self._rows[size].items()}

    def release(self) -> None:
        """Drop the graphs (their memory goes with the last set's: release_outputs)."""
        self._graphs.clear()
        self._rows.clear()

    def _run_into_outputs(self, size: int) -> None:
        for name, tensor in self._body(size).items():
            self._outputs[name][: tensor.shape[0]].copy_(tensor)


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream every CUDA graph of this process is captured on, on one device:
    graphs captured again on a new stream replay slower than the first capture's
    (docs/cuda.md), and a worker captures at start-up's probe, then for real, then at
    each wake-up."""
    return torch.cuda.Stream(device_index)


def capture_all(sets: list[StepGraphs], capture: Capture | None, device: torch.device) -> None:
    """Capture every set, in order, into one memory pool: with capture None, as CUDA
    graphs on device's one capture stream; else the given recorder."""
    if capture is not None:
        for graphs in sets:
            graphs.capture(capture)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_stream(index)
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        cuda = capture_cuda_graph(torch.cuda.graph_pool_handle(), stream)
        for graphs in sets:
            graphs.capture(cuda)
    torch.cuda.current_stream(stream.device).wait_stream(stream)
