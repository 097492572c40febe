"""Dummy weights are one drawn checkpoint, cut like a real one: every layout (TP, PP, EP)
holds its share of the same model, and every parameter is filled."""

from __future__ import annotations

import pytest
import torch

from messages import ModelConfig
from tests.tiny import cached_tiny_checkpoint, moe_checkpoint
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.models.dummy_weights import STD
from zmqworker.models.loader import loading_plan, slice_destination
from zmqworker.models.registry import build_model

CPU = torch.device("cpu")
# (family, (tp_size, pp_size, ep_size)): layouts compared with one rank's model.
CASES = [
    (family, layout)
    for family in ("qwen2", "qwen3_moe", "mixtral")
    for layout in ((2, 1, 1), (1, 2, 1), (2, 1, 2))
    if family != "qwen2" or layout[2] == 1  # a dense model has no experts
]


def _checkpoints() -> dict[str, str]:
    dense = cached_tiny_checkpoint(family="qwen2", num_layers=2, vocab_size=250)
    moe = {family: moe_checkpoint(family) for family in ("qwen3_moe", "mixtral")}
    return {"qwen2": dense, **moe}


def _build(path: str, tp: int, pp: int, ep: int, tp_rank: int, pp_rank: int):
    state = ParallelState(
        pp_rank * tp + tp_rank, tp * pp, tp_rank, tp, pp_rank, pp, None, None, CPU,
        ep_rank=tp_rank if ep > 1 else 0, ep_size=ep,
    )  # fmt: skip
    return build_model(ModelConfig(path=path, load_format="dummy", seed=5), state)


def _whole_tensors(model) -> dict[str, torch.Tensor]:
    """Checkpoint name -> its whole tensor, from one rank's model (every slice whole)."""
    tensors = {}
    for param, s in loading_plan(model):
        tensors.setdefault(s.name, slice_destination(param, s).clone())
    return tensors


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_every_layout_holds_its_share_of_one_drawn_model(family, layout):
    path = _checkpoints()[family]
    whole = _whole_tensors(_build(path, 1, 1, 1, 0, 0))
    tp, pp, ep = layout
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model = _build(path, tp, pp, ep, tp_rank, pp_rank)
            covered = {id(p): 0 for p in model.parameters()}
            for param, s in loading_plan(model):
                full = whole[s.name]
                end = s.start + s.length
                want = full[s.start : end] if s.dim == 0 else full[:, s.start : end]
                assert torch.equal(slice_destination(param, s), want), (s.name, tp_rank, pp_rank)
                covered[id(param)] += want.numel()
            for name, param in model.named_parameters():
                assert covered[id(param)] == param.numel(), f"{name} is not all filled"


def test_drawn_values_follow_transformers_initialisation_and_the_seed():
    path = _checkpoints()["qwen3_moe"]
    a = dict(_build(path, 1, 1, 1, 0, 0).named_parameters())
    b = dict(_build(path, 1, 1, 1, 0, 0).named_parameters())
    for name, param in a.items():
        assert torch.equal(param, b[name]), name
        if name.endswith("norm.weight"):
            assert torch.all(param == 1), name
        elif param.numel() > 1000:
            assert param.std().item() == pytest.approx(STD, rel=0.1), name
    other = build_model(
        ModelConfig(path=path, load_format="dummy", seed=6),
        ParallelState(0, 1, 0, 1, 0, 1, None, None, CPU),
    )
    assert not torch.equal(other.lm_head.weight, a["lm_head.weight"])
