"""Live weight updates on a worker: the WeightTransferEngine (made in load_model, shut
down before the model) and its parts: the model's weights by checkpoint name and the
checks an update passes before any weight changes (catalog.py), an update in progress
(session.py), and writing a piece of a tensor into this rank's slices of it
(pieces.py)."""

from zmqworker.worker.weight_transfer.engine import WeightTransferEngine

__all__ = ["WeightTransferEngine"]
