"""The weight-transfer group: a process group between a trainer (rank 0) and the workers
of one or more engines, and the exchange that carries an update through it.

It is made apart from the workers' own TP/PP groups: its own TCPStore (the trainer's,
which it hosts) and its own backend object (gloo on the CPU, NCCL on CUDA), never
torch.distributed's default group, so it neither joins nor disturbs theirs. Every
collective is bounded by the group's timeout.

An update through the group, on every rank, in this order:
1. the trainer broadcasts a header: the number of tensors and a digest of the
   announcement (WeightUpdate) it sends by; each worker compares it with the one the
   engine announced to it;
2. an all-reduce (min) of a flag: 1 from the trainer, 1 from a worker whose announcement
   passed its checks and matched the header, else 0: on 0 every rank stops there, and
   no weight has changed;
3. each tensor, in the announcement's order, in pieces of whole rows (`pieces`),
   broadcast by the trainer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from messages import WeightSpec, WeightUpdate
from messages.codec import DTYPE_NAMES

STORE_PREFIX = "zmqworker-weights"
DEFAULT_TIMEOUT_S = 300.0
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent (the wire's dtypes: {DTYPE_NAMES})")
    return name


def describe(weights: Iterable[tuple[str, torch.Tensor]], piece_bytes: int = 0) -> WeightUpdate:
    """The announcement of an update made of these (name, tensor) pairs, in order."""
    specs = [WeightSpec(name, dtype_name(t.dtype), list(t.shape)) for name, t in weights]
    return WeightUpdate(tensors=specs, piece_bytes=piece_bytes)


def digest(update: WeightUpdate) -> int:
    """64 bits (as a signed int64) that name an announcement: its encoding's hash."""
    raw = hashlib.blake2b(msgspec.msgpack.encode(update), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def pieces(shape: list[int], itemsize: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(row_start, num_rows) of each piece of a tensor of this shape: whole rows along
    dim 0, at most piece_bytes each (a row larger than that is a piece alone); the
    whole tensor when piece_bytes is 0."""
    rows = shape[0] if shape else 1
    row_bytes = math.prod(shape[1:]) * itemsize
    if piece_bytes <= 0 or rows == 0:
        return [(0, rows)]
    per_piece = max(1, piece_bytes // max(1, row_bytes))
    return [(start, min(per_piece, rows - start)) for start in range(0, rows, per_piece)]


class WeightGroup:
    """One rank's membership in a weight-transfer group. Rank 0 (the trainer) hosts the
    rendezvous store at host:port; construction returns once every rank has joined,
    or raises after timeout_s."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a weight-transfer group needs >= 2 ranks, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside the group's {world_size} ranks")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
        store = dist.PrefixStore(STORE_PREFIX, self._store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.barrier()  # every rank's backend is up before the first update

    def broadcast(self, tensor: torch.Tensor) -> None:
        """tensor (contiguous, on the group's device) from rank 0 to every rank."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._pg.broadcast([tensor], options).wait()

    def all_min(self, value: int) -> int:
        """The smallest of every rank's value."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([t], options).wait()
        return int(t.item())

    def barrier(self) -> None:
        self.all_min(0)

    def exchange_header(self, update: WeightUpdate | None) -> tuple[int, int]:
        """Step 1: rank 0 sends (number of tensors, digest) of update; every rank gets them."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            assert update is not None
            header[0], header[1] = len(update.tensors), digest(update)
        self.broadcast(header)
        count, sent_digest = header.tolist()
        return count, sent_digest

    def agree(self, ok: bool) -> bool:
        """Step 2: whether every rank is ready for the tensors."""
        return self.all_min(1 if ok else 0) == 1

    def close(self) -> None:
        """Leave the group: its backend's connections and the store's go."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
        self._store = None
