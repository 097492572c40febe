"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on one rank against transformers, on
tiny random checkpoints with uneven routing: logits and greedy tokens through the paged
KV cache, both checkpoint layouts, dummy weights, and how the experts are cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from messages import ModelConfig
from tests.test_models import _hf_model, assert_close, hf_logits, ours, prompts
from tests.tiny import MOE_CHECKPOINTS, PagedDriver, moe_checkpoint
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.models.expert_split import MoeSizes, expert_split
from zmqworker.models.layers.experts import route
from zmqworker.models.moe import SparseMoeBlock, sparse_layer
from zmqworker.models.registry import build_model

CPU = torch.device("cpu")
FAMILIES = sorted(MOE_CHECKPOINTS)


def greedy(driver: PagedDriver, prompt: list[int], n: int) -> list[int]:
    """Prefill in two chunks, then n greedy decode steps."""
    driver.step({"r": prompt[:6]})
    logits = driver.step({"r": prompt[6:]})["r"]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.step({"r": tokens[-1:]})["r"]
    return tokens


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = _hf_model(path).generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(family):
    path = moe_checkpoint(family)
    a, b, _ = prompts()
    driver = PagedDriver(ours(path))
    got = {"a": [], "b": []}
    for schedule in ({"a": a[:8], "b": b}, {"a": a[8:]}, {"a": [7], "b": [250]}):
        for req, logits in driver.step(schedule).items():
            got[req].append(logits)
    assert_close(torch.cat(got["a"]), hf_logits(path, a + [7]))
    assert_close(torch.cat(got["b"]), hf_logits(path, b + [250]))
    assert greedy(PagedDriver(ours(path)), a, 10) == hf_greedy(path, a, 10)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_routers_are_uneven(family):
    """What the parity tests cover: in every mixture-of-experts layer some experts take
    many of the prompts' tokens, others none."""
    path = moe_checkpoint(family)
    model = ours(path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    logits: list[torch.Tensor] = []
    hooks = [b.gate.register_forward_hook(lambda m, i, o: logits.append(o)) for b in blocks]
    PagedDriver(model).step(dict(zip("abc", prompts(), strict=True)))
    for hook in hooks:
        hook.remove()
    for block, layer_logits in zip(blocks, logits, strict=True):
        _, ids = route(layer_logits, block.top_k, block.renormalize)
        counts = torch.bincount(ids.flatten(), minlength=block.split.num_experts)
        assert (counts == 0).any() and counts.max() >= 8, counts


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_experts_as_transformers_holds_them_load_the_same(family, tmp_path):
    """transformers keeps every layer's experts stacked (mlp.experts.gate_up_proj and
    down_proj, the router as mlp.gate) and may save them so: such a folder loads the same
    weights as the published per-expert layout."""
    path = moe_checkpoint(family)
    state = {k: v.contiguous() for k, v in _hf_model(path).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    for name in ("config.json", "generation_config.json"):
        if Path(path, name).exists():
            (tmp_path / name).write_bytes(Path(path, name).read_bytes())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    published = ours(path).state_dict()
    stacked = ours(str(tmp_path)).state_dict()
    assert published.keys() == stacked.keys()
    for name in published:
        assert torch.equal(published[name], stacked[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_build_and_run(family):
    path = moe_checkpoint(family)
    model = build_model(
        ModelConfig(path=path, load_format="dummy", seed=3),
        ParallelState(0, 1, 0, 1, 0, 1, None, None, CPU),
    )
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.experts.w13.std().item() == pytest.approx(0.02, rel=0.2)
    logits = PagedDriver(model).step({"r": prompts()[0]})["r"]
    assert torch.isfinite(logits).all()


def test_sparse_layers_follow_the_config():
    cfg = transformers.Qwen3MoeConfig(
        num_hidden_layers=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        num_experts=4,
        num_experts_per_tok=2,
    )
    assert [i for i in range(6) if sparse_layer(cfg, i)] == [1, 5]
    assert not sparse_layer(transformers.Qwen3MoeConfig(num_experts=0), 0)
    assert all(sparse_layer(transformers.MixtralConfig(), i) for i in range(4))


def test_experts_are_cut_over_tp_or_dealt_out_whole_with_expert_parallelism():
    sizes = MoeSizes(num_experts=8, top_k=2, intermediate=56)
    tp = [expert_split(sizes, 2, r, 1, 0) for r in range(2)]
    assert [(s.first, s.count, s.inter_start, s.inter_len) for s in tp] == [
        (0, 8, 0, 28),
        (0, 8, 28, 28),
    ]
    ep = [expert_split(sizes, 4, r, 4, r) for r in range(4)]
    assert [(s.first, s.count, s.inter_start, s.inter_len) for s in ep] == [
        (0, 2, 0, 56),
        (2, 2, 0, 56),
        (4, 2, 0, 56),
        (6, 2, 0, 56),
    ]
    with pytest.raises(
        ValueError, match="8 experts are not divisible by the expert-parallel size 3"
    ):
        expert_split(sizes, 3, 0, 3, 0)
    with pytest.raises(ValueError, match="intermediate size 56 is not divisible by tensor_paral"):
        expert_split(sizes, 3, 0, 1, 0)


def test_a_rank_loads_only_its_experts():
    """With expert parallelism a rank's stacks hold its experts whole, read from their own
    tensors; without it, every expert's slice of the intermediate size."""
    path = moe_checkpoint("mixtral")
    hf = _hf_model(path).model.layers[1].mlp.experts
    ep_state = ParallelState(1, 2, 1, 2, 0, 1, None, None, CPU, ep_rank=1, ep_size=2)
    experts = build_model(ModelConfig(path=path), ep_state).model.layers["1"].mlp.experts
    assert torch.equal(experts.w13, hf.gate_up_proj[3:6]) and torch.equal(
        experts.w2, hf.down_proj[3:6]
    )
    tp_state = ParallelState(1, 2, 1, 2, 0, 1, None, None, CPU)
    experts = build_model(ModelConfig(path=path), tp_state).model.layers["1"].mlp.experts
    gate, up = hf.gate_up_proj[:, 20:40], hf.gate_up_proj[:, 60:80]
    assert torch.equal(experts.w13, torch.cat([gate, up], dim=1))
    assert torch.equal(experts.w2, hf.down_proj[:, :, 20:40])
