"""Dummy weights (load_format="dummy"): a checkpoint drawn rather than read.

Each checkpoint tensor the model's layers ask for is drawn whole from a generator seeded
by the run's seed and the tensor's name, and then cut exactly as a real checkpoint is
(loader.loading_plan). So the weights do not depend on the layout: every TP rank, pipeline
stage and expert-parallel rank holds its share of the same model, a replicated tensor (a
router, a norm) is the same on every rank, and reruns give the same weights.
"""

from __future__ import annotations

import zlib
from collections import defaultdict

import torch
from torch import nn

from zmqworker.models.layers.weights import TensorSlice
from zmqworker.models.loader import cut, loading_plan, slice_destination

# transformers' initialisation: normal(0, 0.02), norm weights 1, biases 0.
STD = 0.02


def _seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def _draw(name: str, shape: tuple[int, ...], like: torch.Tensor, seed: int) -> torch.Tensor:
    """The whole checkpoint tensor `name`, in like's dtype on like's device."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    generator = torch.Generator(device=like.device).manual_seed(_seed(seed, name))
    full = torch.empty(shape, dtype=like.dtype, device=like.device)
    return full.normal_(0.0, STD, generator=generator)


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter the model's layers plan to load from drawn checkpoint tensors,
    one whole tensor in memory at a time."""
    by_name: dict[str, list[tuple[torch.Tensor, TensorSlice]]] = defaultdict(list)
    for param, s in loading_plan(model):
        by_name[s.name].append((param, s))
    for name, entries in by_name.items():
        full = _draw(name, entries[0][1].shape, entries[0][0], seed)
        for param, s in entries:
            slice_destination(param, s).copy_(cut(full, s))
