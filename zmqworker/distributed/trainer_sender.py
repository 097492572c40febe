"""The trainer's end of a weight-transfer group (weight_group.py): it joins as rank 0
and broadcasts named tensors to every worker of the engines that joined.

    sender = TrainerWeightSender("10.0.0.5", 29600, world_size=1 + num_workers)
    update = sender.announce(model.named_parameters())
    # the engine, given `update` (a msgspec Struct) however the two processes talk:
    #     llm.update_weights_from_group(update)
    sender.send(model.named_parameters(), update)  # at the same time

Both calls return once every worker has taken the update, or raise: on a refusal (a
name, shape or dtype the model does not have, or tensors that differ from the
announcement) before any weight has changed, the group still usable; on a failure
halfway, with the group closed (a new sender is needed) and the workers refusing steps
until a whole update or a reload.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from messages import WeightUpdate
from zmqworker.distributed.weight_group import (
    DEFAULT_TIMEOUT_S,
    WeightGroup,
    describe,
    pieces,
)

# Tensors go in pieces of whole rows of at most this many bytes: the workers' scratch
# buffer (for a TP shard or a fused parameter) stays this small whatever the model.
DEFAULT_PIECE_BYTES = 256 << 20


class TrainerWeightSender:
    """Rank 0 of a weight-transfer group of world_size ranks (1 + every worker of every
    engine), hosting its rendezvous at host:port. device: where the broadcasts run
    ("cuda" for NCCL, "cpu" for gloo), which must be the workers' kind of device."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        device: str | torch.device = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
    ) -> None:
        if piece_bytes < 0:
            raise ValueError(f"piece_bytes must be >= 0, got {piece_bytes}")
        self.piece_bytes = piece_bytes
        self.group = WeightGroup(host, port, world_size, 0, torch.device(device), timeout_s)

    def announce(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdate:
        """What the engine's update_weights_from_group takes for these tensors."""
        return describe(weights, self.piece_bytes)

    @torch.no_grad()
    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], update: WeightUpdate | None = None
    ) -> None:
        """Broadcast the tensors, in order; update: the announcement the engine was
        given (by default, announce(weights)), which they must match."""
        weights = list(weights)
        update = update if update is not None else self.announce(weights)
        matches = describe(weights, update.piece_bytes) == update
        group = self.group
        # The workers wait in these steps: a refusal of ours goes through them too, so
        # that they fail at once and the group stays usable.
        group.exchange_header(update)
        if not group.agree(matches):
            if not matches:
                raise ValueError(
                    "the tensors differ from the announcement (names, dtypes or shapes); "
                    "no weight has changed"
                )
            raise RuntimeError(
                "the workers refused the update (update_weights_from_group on the engine "
                "says why); no weight has changed"
            )
        try:
            for spec, (_, tensor) in zip(update.tensors, weights, strict=True):
                tensor = tensor.detach()
                for start, rows in pieces(spec.shape, tensor.element_size(), update.piece_bytes):
                    piece = tensor.narrow(0, start, rows) if tensor.dim() else tensor
                    group.broadcast(piece.to(group.device).contiguous())
        except BaseException:
            # Halfway: closing the group fails the workers' broadcasts at once (they
            # refuse steps until a whole update or a reload) rather than at its timeout.
            group.close()
            raise

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> TrainerWeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
