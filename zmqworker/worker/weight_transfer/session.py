"""An update between its announcement and its end: which rows of each announced tensor
have come (once any of a weight has, the model's weights may have changed, on this rank
or another: every rank of the update counts every tensor's rows alike), whether a tied
model's head that came equals its embedding, and the engine's shared-memory segments
mapped for it (unmapped when it ends)."""

from __future__ import annotations

import numpy as np
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
        self._received: dict[str, np.ndarray] = {}  # of each tensor, its rows come so far
        # Rows of a weight have come (every rank alike), or this rank's started changing.
        self.touched = False
        # Why the update is refused once it ends (a tied head that differs from its
        # embedding): the rows keep coming meanwhile, as the group's exchange needs.
        self.refusal: str | None = None
        self.chunk_failed = False  # on this rank: other ranks may have taken the chunk
        # Rows of a tied head that came before the embedding's rows: compared at the end.
        self._head_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._segments: dict[tuple[int, int, int], MappedSegment] = {}

    def spec(self, name: str) -> WeightSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"tensor {name} was not announced in this update")
        return spec

    def count_rows(self, name: str, row_start: int, num_rows: int) -> None:
        """Note rows [row_start, + num_rows) of name as received: each row once, so that
        an update is whole only when every row of every tensor came."""
        total = self.spec(name).shape[0]
        end = row_start + num_rows
        if row_start < 0 or num_rows < 0 or end > total:
            raise ValueError(f"tensor {name}: rows {row_start}..{end} of its {total}")
        received = self._received.get(name)
        if received is None:
            received = self._received[name] = np.zeros(total, np.bool_)
        again = np.flatnonzero(received[row_start:end])
        if len(again):
            raise ValueError(
                f"tensor {name}: row {row_start + int(again[0])} came twice in this update "
                f"(rows {row_start}..{end}); each row is sent once"
            )
        received[row_start:end] = True
        if name not in self.catalog.aliases:
            self.touched = True

    def take(self, name: str, row_start: int, piece: torch.Tensor) -> None:
        """Rows of a tensor, in a buffer of the sender's (copied out before return)."""
        self.count_rows(name, row_start, piece.shape[0])
        source = self.catalog.aliases.get(name)
        if source is not None:
            self._compare_head(name, source, row_start, piece)
            return
        targets = self.catalog.targets.get(name)
        if targets:
            write_piece(targets, row_start, piece)

    def _compare_head(self, name: str, source: str, row_start: int, piece: torch.Tensor) -> None:
        """A tied head's rows: they must equal the embedding's rows that this update gives
        (compared at the end if they have not come yet), or the embedding's rows now when
        it gives none. Each rank compares the rows it holds of the embedding."""
        received = self._received.get(source)
        for param, s in self.catalog.targets.get(source, []):
            lo, hi = max(s.start, row_start), min(s.start + s.length, row_start + len(piece))
            if lo >= hi or s.dim != 0 or s.dst_expert is not None:
                continue
            mine = param.data.narrow(0, s.dst_start + lo - s.start, hi - lo)
            given = piece.narrow(0, lo - row_start, hi - lo)
            if source in self.specs and (received is None or not received[lo:hi].all()):
                # The embedding's rows are still to come: these, kept in host memory.
                self._head_rows.append((mine, given.to("cpu", copy=True)))
            elif not torch.equal(mine, given.to(mine.device)):
                self._refuse_head(name, source)

    def _refuse_head(self, name: str, source: str) -> None:
        self.refusal = self.refusal or (
            f"tensor {name} differs from {source}: this model ties them "
            "(tie_word_embeddings) and holds one tensor for both, so an update gives "
            f"{name} only equal to the {source} it gives (or holds, if it gives none)"
        )

    def check_head(self) -> None:
        """At the end, with every row come: the head's rows that came before the
        embedding's against them."""
        rows, self._head_rows = self._head_rows, []
        if any(not torch.equal(mine.cpu(), given) for mine, given in rows):
            self._refuse_head(*next(iter(self.catalog.aliases.items())))

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
        # The opened tensors live in this list alone (no loop variable of this frame holds
        # one), so that they go where releasing() says.
        tensors: list[tuple[str, torch.Tensor]] = []
        try:
            for ref in chunk.tensors:  # every ref checked before any is copied
                tensors.append((ref.name, opener.tensor(ref, self.spec(ref.name))))
            self._take_all(tensors)
            self.wait_for_copies()  # before the engine's memory is let go
        finally:
            with opener.releasing():
                tensors.clear()

    def _take_all(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.take(name, 0, tensor)

    def wait_for_copies(self) -> None:
        """Until the copies queued on the device are done (one event, no other sync)."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    def missing(self) -> list[str]:
        """The announced tensors not wholly received."""
        return [
            name
            for name, spec in self.specs.items()
            if not (spec.shape[0] == 0 or (name in self._received and self._received[name].all()))
        ]

    def close(self) -> None:
        self._head_rows = []
        self._segments.clear()  # unmapped once no view of them is left
