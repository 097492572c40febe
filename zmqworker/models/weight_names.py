"""A model's weights by checkpoint name, for updates that arrive as Hugging Face names and
whole tensors: the slices this rank takes of each (the loader's own mapping: fused q/k/v
and gate/up, tied embeddings, TP shards, PP layers), and every name of the whole model
with its full shape, so that a name of another stage is known and a wrong one is not.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.models.layers.weights import TensorSlice
from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.loader import loading_plan

# A tied model's checkpoint may carry the LM head under its own name too (transformers'
# state_dict does): it is the embedding, which comes under its own name.
TIED_HEAD = "lm_head.weight"

# What two checkpoints must share for one's weights to go into a model built for the
# other: the architecture and every size a parameter's shape or the forward depends on.
SHAPE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
)

Targets = dict[str, list[tuple[nn.Parameter, TensorSlice]]]


def weight_targets(model: nn.Module) -> Targets:
    """Checkpoint name -> the (parameter, slice) pairs of this rank that take from it."""
    targets: Targets = defaultdict(list)
    for param, s in loading_plan(model):
        targets[s.name].append((param, s))
    return dict(targets)


def checkpoint_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every weight name of the whole model (all stages, unsharded) -> its full shape:
    the same layers built on the meta device for one rank, which costs no memory."""
    meta = torch.device("meta")
    state = single_rank_state(meta)
    with meta:
        whole = LlamaForCausalLM(model.hf_config, state, model.dtype, model.flags, 1)
    return {s.name: s.shape for _, s in loading_plan(whole)}


def ties_embeddings(model: LlamaForCausalLM) -> bool:
    return bool(getattr(model.hf_config, "tie_word_embeddings", False))


def config_differences(ours: Any, theirs: Any) -> list[str]:
    """'key: ours vs theirs' for each of SHAPE_KEYS on which two configs differ (the
    architecture list too)."""
    diffs = [
        f"{key}: {getattr(ours, key, None)!r} vs {getattr(theirs, key, None)!r}"
        for key in SHAPE_KEYS
        if getattr(ours, key, None) != getattr(theirs, key, None)
    ]
    if getattr(ours, "architectures", None) != getattr(theirs, "architectures", None):
        diffs.append(f"architectures: {ours.architectures!r} vs {theirs.architectures!r}")
    return diffs
