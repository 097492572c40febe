"""A pull over tcp split by layers over several connections, and its parts put together.

ZeroMQ runs a connection's CURVE (encryption on the server, decryption on the puller) on
one I/O thread of each side, which bounds one connection's throughput whatever the
network carries. A pull from a producer that answers over tcp (another host) goes as
parts of whole layers, each over a connection of its own (KVPull.layers), so that the
I/O threads of both sides (TCP_STREAMS each) run the parts side by side. Whole layers,
because a run of layers lies contiguous in the producer's staging: the server sends each
part without a copy. The puller copies each part into its place in one buffer as it
comes, which the worker's thread then copies in as it would one answer. A pull of some
of the staged layers only (a decode stage of another stage count) goes as parts of
those, even as one part: only they travel. So does the first pull from a producer not
yet known to share the host (split over one stream): one part, which a producer on this
host answers in place instead.
"""

from __future__ import annotations

import numpy as np
import zmq

from messages.kv_peer import KVBlocks, KVLayout
from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer.blocks import staged_nbytes
from zmqworker.kv_transfer.head_map import HeadSource

TCP_STREAMS = 4  # connections a pull may take, and the I/O threads of each side
MIN_PART_BYTES = 1 << 20  # below this, a part's own round trip costs more than it saves


def layer_parts(num_layers: int, nbytes: int, streams: int = TCP_STREAMS) -> list[tuple[int, int]]:
    """[first, count] of the layers of each part of a pull of nbytes over num_layers
    layers: up to streams of them, of MIN_PART_BYTES at least (or one, the whole)."""
    count = max(1, min(streams, num_layers, nbytes // MIN_PART_BYTES))
    bounds = [i * num_layers // count for i in range(count + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


def split(
    layout: KVLayout, load: KVLoad, source: HeadSource, streams: int = TCP_STREAMS
) -> Parts | None:
    """The parts of a pull over tcp of load's piece from source (layout: this rank's
    cache) over up to streams connections, where it is large enough for more than one,
    or takes some of the staged layers only; None: one pull of them all. With one
    stream, the window of a first pull, which a producer on this host answers in place."""
    staged, wanted = source.staged_layout(layout), source.taken_layout(layout)
    num, first = len(load.block_ids), load.num_cached_blocks
    parts = layer_parts(wanted.num_layers, staged_nbytes(wanted, num - first), streams)
    if len(parts) == 1 and wanted.num_layers == staged.num_layers:
        return None
    taken, _ = source.layer_slices(layout.num_layers)
    asked = [(taken.start + a, count) for a, count in parts]
    return Parts(asked, staged, wanted, num, first)


class Parts:
    """The parts of one pull as they come, each answer checked and its bytes copied into
    its layers' place in buffer: staged (the producer's layout) over num_staged blocks,
    of which the pull takes layout (its heads of its layers, the staged ones from
    first_layer on) from first_block on."""

    def __init__(
        self,
        asked: list[tuple[int, int]],
        staged: KVLayout,
        layout: KVLayout,
        num_staged: int,
        first_block: int,
    ) -> None:
        self.asked = asked
        self.first_layer = asked[0][0]
        self.staged, self.layout = staged, layout
        self.num_staged, self.first_block = num_staged, first_block
        self.buffer = np.empty(staged_nbytes(layout, num_staged - first_block), np.uint8)
        self._layer_bytes = len(self.buffer) // layout.num_layers
        self._missing = set(asked)
        self.error: str | None = None  # the first part's that failed: the pull fails

    @property
    def complete(self) -> bool:
        """Every part was answered (copied in, or failed)."""
        return not self._missing

    def take(self, reply: KVBlocks, frames: list[zmq.Frame]) -> None:
        """An answer to one of the parts."""
        layers = reply.layers
        if layers not in self._missing:
            error = f"an answer for layers {layers}: not a part asked, or one answered"
        else:
            self._missing.discard(layers)
            error = reply.error or self._wrong(reply, frames)
        if error is not None:
            self.error = self.error or error
            return
        assert layers is not None
        start = (layers[0] - self.first_layer) * self._layer_bytes
        end = start + layers[1] * self._layer_bytes
        self.buffer[start:end] = np.frombuffer(frames[0].buffer, np.uint8)

    def _wrong(self, reply: KVBlocks, frames: list[zmq.Frame]) -> str | None:
        """What makes reply (no error) not the bytes of its part, or None."""
        if reply.cuda or reply.host_cache or reply.shared:
            return "a part answered other than over tcp"
        if reply.layout != self.staged or reply.num_blocks != self.num_staged:
            return (f"a part of {reply.num_blocks} blocks of {reply.layout}, "
                    f"not {self.num_staged} of {self.staged}")  # fmt: skip
        if reply.first_block != self.first_block:
            return f"a part from block {reply.first_block}, not {self.first_block}"
        assert reply.layers is not None
        nbytes = reply.layers[1] * self._layer_bytes
        got = [len(f.buffer) for f in frames]
        if got != [nbytes]:
            return f"expected one frame of {nbytes} bytes for layers {reply.layers}, got {got}"
        return None
