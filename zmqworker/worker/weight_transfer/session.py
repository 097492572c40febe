"""An update between its announcement and its end: which rows of each announced tensor
have come, whether any weight of this rank has changed, and the engine's shared-memory
segments mapped for it (unmapped when it ends)."""

from __future__ import annotations

import torch

from messages import CudaWeights, SharedWeights, WeightSpec
from zmqworker.distributed.cuda_ipc import CudaOpener
from zmqworker.distributed.weight_segment import MappedSegment
from zmqworker.worker.weight_transfer.catalog import WeightCatalog
from zmqworker.worker.weight_transfer.pieces import write_piece


class UpdateSession:
    def __init__(
        self, catalog: WeightCatalog, specs: dict[str, WeightSpec], device: torch.device
    ) -> None:
        self.catalog = catalog
        self.device = device
        self.specs = specs
        self.rows = dict.fromkeys(specs, 0)  # rows received of each tensor
        self.touched = False  # a weight of this rank has changed
        self._segments: dict[tuple[int, int, int], MappedSegment] = {}

    def spec(self, name: str) -> WeightSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"tensor {name} was not announced in this update")
        return spec

    def count_rows(self, name: str, row_start: int, num_rows: int) -> None:
        """Note rows [row_start, + num_rows) of name as received."""
        total = self.spec(name).shape[0]
        if row_start + num_rows > total or self.rows[name] + num_rows > total:
            raise ValueError(
                f"tensor {name}: more rows than its {total} (rows {row_start}.."
                f"{row_start + num_rows}, {self.rows[name]} received before)"
            )
        self.rows[name] += num_rows

    def take(self, name: str, row_start: int, piece: torch.Tensor) -> None:
        """Rows of a tensor, in a buffer of the sender's (copied out before return)."""
        self.count_rows(name, row_start, piece.shape[0])
        targets = self.catalog.targets.get(name)
        if targets:
            self.touched = True
            write_piece(targets, row_start, piece)

    def take_shared(self, chunk: SharedWeights) -> None:
        key = (chunk.pid, chunk.fd, chunk.generation)
        segment = self._segments.get(key)
        if segment is None:
            segment = self._segments[key] = MappedSegment(chunk)
        pieces = [(ref, segment.piece(ref, self.spec(ref.name))) for ref in chunk.tensors]
        for ref, piece in pieces:  # every ref checked before any is copied
            self.take(ref.name, ref.row_start, piece)
        self.wait_for_copies()  # the engine reuses the segment once answered

    def take_cuda(self, chunk: CudaWeights) -> None:
        opener = CudaOpener()
        tensors: list[tuple[str, torch.Tensor]] = []
        try:
            for ref in chunk.tensors:  # every ref checked before any is copied
                tensors.append((ref.name, opener.tensor(ref, self.spec(ref.name))))
            for name, tensor in tensors:
                self.take(name, 0, tensor)
            self.wait_for_copies()  # before the engine's memory is let go
        finally:
            with opener.releasing():
                tensors.clear()

    def wait_for_copies(self) -> None:
        """Until the copies queued on the device are done (one event, no other sync)."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def missing(self) -> list[str]:
        """The announced tensors not wholly received."""
        return [name for name, spec in self.specs.items() if self.rows[name] < spec.shape[0]]

    def close(self) -> None:
        self._segments.clear()  # unmapped once no view of them is left
