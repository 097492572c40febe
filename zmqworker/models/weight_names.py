"""A model's weights by checkpoint name, for updates that arrive as Hugging Face names and
whole tensors: the slices this rank takes of each (the loader's own mapping: fused q/k/v
and gate/up, tied embeddings, TP shards, PP layers), and every name of the whole model
with its full shape, so that a name of another stage is known and a wrong one is not.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from zmqworker.models.layers.rotary import rope_parameters_of
from zmqworker.models.layers.weights import TensorSlice
from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.loader import parameter_sources

# A tied model's checkpoint may carry the LM head under its own name too (transformers'
# state_dict does): it is the embedding, which comes under its own name.
TIED_HEAD = "lm_head.weight"

# What two checkpoints must share for one's weights to go into a model built for the
# other: the architecture and every value a parameter's shape or the forward depends on
# (a model is built once: another checkpoint's rope or routing would be silently ignored).
MODEL_KEYS = (
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
    "rms_norm_eps",
    "max_position_embeddings",  # yarn's and dynamic rope's scaling
    "partial_rotary_factor",
    "sliding_window",
    "layer_types",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    # The loader refuses a quantized checkpoint; a reload names this difference first.
    "quantization_config",
    "compression_config",
)

Targets = dict[str, list[tuple[nn.Parameter, TensorSlice]]]


def weight_targets(model: nn.Module) -> Targets:
    """Checkpoint name -> the (parameter, slice) pairs of this rank that take from it,
    under every name a parameter's layouts give (experts published or stacked)."""
    targets: Targets = defaultdict(list)
    for param, layouts in parameter_sources(model):
        for layout in layouts:
            for s in layout:
                targets[s.name].append((param, s))
    return dict(targets)


def layout_names(model: nn.Module) -> list[tuple[frozenset[str], ...]]:
    """For each parameter of the model, the names of each layout it can come in: an
    update that fills it gives every name of one of them."""
    return [
        tuple(frozenset(s.name for s in layout) for layout in layouts)
        for _, layouts in parameter_sources(model)
    ]


def checkpoint_shapes(whole: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every weight name of a whole model (whole_model), in every layout -> its full shape."""
    return {
        s.name: s.shape
        for _, layouts in parameter_sources(whole)
        for layout in layouts
        for s in layout
    }


def ties_embeddings(model: LlamaForCausalLM) -> bool:
    return bool(getattr(model.hf_config, "tie_word_embeddings", False))


def config_differences(ours: Any, theirs: Any) -> list[str]:
    """'key: ours vs theirs' for each of MODEL_KEYS on which two configs differ (the
    architecture list and the rope settings too)."""
    diffs = [
        f"{key}: {getattr(ours, key, None)!r} vs {getattr(theirs, key, None)!r}"
        for key in MODEL_KEYS
        if getattr(ours, key, None) != getattr(theirs, key, None)
    ]
    if (rope := rope_parameters_of(ours)) != (other := rope_parameters_of(theirs)):
        diffs.append(f"rope_parameters: {rope!r} vs {other!r}")
    if getattr(ours, "architectures", None) != getattr(theirs, "architectures", None):
        diffs.append(f"architectures: {ours.architectures!r} vs {theirs.architectures!r}")
    return diffs
