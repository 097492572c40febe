"""From a checkpoint folder to this rank's model: config, family, layers, weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from messages import ModelConfig
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.models.architectures import SUPPORTED, supported_architecture
from zmqworker.models.dummy_weights import fill_dummy_weights
from zmqworker.models.hf_config import load_hf_config
from zmqworker.models.layers.experts import ExpertNames
from zmqworker.models.llama import FamilyFlags, LlamaForCausalLM
from zmqworker.models.moe import MoeFlags

CausalLM = LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _llama_flags(cfg: Any) -> FamilyFlags:
    bias = bool(getattr(cfg, "attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def _qwen3_flags(cfg: Any) -> FamilyFlags:
    bias = bool(getattr(cfg, "attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _qwen3_moe_flags(cfg: Any) -> FamilyFlags:
    names = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
    moe = MoeFlags(names, renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
    return dataclasses.replace(_qwen3_flags(cfg), moe=moe)


# Mixtral's router renormalises its top k (a softmax over the chosen logits).
_MIXTRAL = FamilyFlags(moe=MoeFlags(ExpertNames("block_sparse_moe", "w1", "w3", "w2"), True))


# Each supported architecture's flags of its family member.
FAMILY_FLAGS: dict[str, Callable[[Any], FamilyFlags]] = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": lambda cfg: FamilyFlags(),
    "Qwen2ForCausalLM": lambda cfg: FamilyFlags(qkv_bias=True),
    "Qwen3ForCausalLM": _qwen3_flags,
    "Qwen3MoeForCausalLM": _qwen3_moe_flags,
    "MixtralForCausalLM": lambda cfg: _MIXTRAL,
}
assert FAMILY_FLAGS.keys() == SUPPORTED.keys()


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def family_flags(cfg: Any) -> FamilyFlags:
    """The flags of a supported architecture; an error naming it and the supported list."""
    arch = supported_architecture(
        getattr(cfg, "architectures", None), getattr(cfg, "model_type", None)
    )
    return FAMILY_FLAGS[arch](cfg)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


LOAD_FORMATS = ("auto", "dummy")


def build_model(model_config: ModelConfig, state: ParallelState, fused: bool = False) -> CausalLM:
    """This rank's layers on state.device in model_config.dtype, weights loaded, eval mode.
    fused builds the layers on Triton kernels (the CUDA step)."""
    if model_config.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
            f"{model_config.load_format!r}"
        )
    cfg = load_hf_config(model_config.path)
    flags = family_flags(cfg)
    dtype = torch_dtype(model_config.dtype)
    max_positions = model_config.max_model_len or cfg.max_position_embeddings
    with torch.device(state.device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg, state, dtype, flags, max_positions, fused)
    load_weights(model, model_config)
    return model.eval()


def load_weights(model: CausalLM, model_config: ModelConfig) -> None:
    """Fill this rank's parameters: from the checkpoint folder, or dummy values made on
    the device (also what a wake-up from level-2 sleep calls)."""
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(model_config.path)
