"""Mixture-of-experts shapes for bench/gpu_decode.py, and what their steps must do.

A decode step must read the attention weights, the routers, the experts its tokens chose
(their union, in each layer) and the KV history: not every expert. The experts chosen
are measured in the run, from the routers' logits during one eager step of each row
(expected_union gives what uniform random routing would choose, for comparison). A
prefill's work counts each token's top k experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zmqworker.models.moe import SparseMoeBlock

# The published configs' shapes (dummy weights: nothing is downloaded).
MOE_SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "mixtral-8x7b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}
CONFIG_CLASSES = {"qwen3-30b-a3b": "Qwen3MoeConfig", "mixtral-8x7b": "MixtralConfig"}


def moe_blocks(model: torch.nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def expected_union(num_experts: int, top_k: int, tokens: int) -> float:
    """The distinct experts `tokens` tokens choose under uniform random routing (each
    token's top_k distinct)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@contextmanager
def eager_steps(runner) -> Iterator[None]:
    """The runner's steps run eagerly (the routers' hooks see them): neither its decode
    graphs nor its token graphs replay."""
    path = runner.path
    graphs = path.graphs, path.token_graphs
    path.graphs = path.token_graphs = None
    try:
        yield
    finally:
        path.graphs, path.token_graphs = graphs


@contextmanager
def experts_chosen(model: torch.nn.Module) -> Iterator[list[int]]:
    """Per MoE layer and forward run inside, the number of distinct experts chosen."""
    chosen: list[int] = []

    def watch(block: SparseMoeBlock):
        def hook(module, inputs, logits):
            ids = torch.topk(logits, block.top_k, dim=-1).indices
            chosen.append(int(ids.unique().numel()))

        return hook

    hooks = [b.gate.register_forward_hook(watch(b)) for b in moe_blocks(model)]
    try:
        yield chosen
    finally:
        for hook in hooks:
            hook.remove()


def unread_expert_bytes(model: torch.nn.Module, chosen: list[int]) -> int:
    """The bytes of the experts a step's tokens did not choose (chosen: per layer)."""
    unread = 0
    blocks = moe_blocks(model)
    for block, count in zip(blocks, chosen[-len(blocks) :], strict=True):
        w13, w2 = block.experts.w13, block.experts.w2
        size = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
        unread += size * (block.split.count - count) // block.split.count
    return unread


def active_expert_params(model: torch.nn.Module) -> float:
    """Expert parameters one token multiplies: its top k experts' in every MoE layer."""
    return sum(
        (b.experts.w13.numel() + b.experts.w2.numel()) * b.top_k / b.split.num_experts
        for b in moe_blocks(model)
    )
