"""From a checkpoint folder to this rank's model: config, family, layers, weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

from messages import ModelConfig
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.models.llama import FamilyFlags, LlamaForCausalLM

CausalLM = LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _llama_flags(cfg: Any) -> FamilyFlags:
    bias = bool(getattr(cfg, "attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


def _qwen3_flags(cfg: Any) -> FamilyFlags:
    bias = bool(getattr(cfg, "attention_bias", False))
    return FamilyFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)


# Architecture -> (model_type, flags of that family member).
ARCHITECTURES: dict[str, tuple[str, Callable[[Any], FamilyFlags]]] = {
    "LlamaForCausalLM": ("llama", _llama_flags),
    "MistralForCausalLM": ("mistral", lambda cfg: FamilyFlags()),
    "Qwen2ForCausalLM": ("qwen2", lambda cfg: FamilyFlags(qkv_bias=True)),
    "Qwen3ForCausalLM": ("qwen3", _qwen3_flags),
}


def load_hf_config(path: str) -> transformers.PretrainedConfig:
    """The checkpoint's config.json, read locally (never from a hub)."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
    return transformers.AutoConfig.from_pretrained(path, local_files_only=True)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def family_flags(cfg: Any) -> FamilyFlags:
    """The flags of a supported architecture; an error naming it and the supported list."""
    by_model_type = {model_type: flags for model_type, flags in ARCHITECTURES.values()}
    for arch in getattr(cfg, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch][1](cfg)
    model_type = getattr(cfg, "model_type", None)
    if not getattr(cfg, "architectures", None) and model_type in by_model_type:
        return by_model_type[model_type](cfg)
    raise ValueError(
        f"unsupported architecture {getattr(cfg, 'architectures', None)} "
        f"(model_type {model_type!r}); supported: {sorted(ARCHITECTURES)}"
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(model_config: ModelConfig, state: ParallelState) -> CausalLM:
    """This rank's layers on state.device in model_config.dtype, weights loaded, eval mode."""
    cfg = load_hf_config(model_config.path)
    flags = family_flags(cfg)
    dtype = torch_dtype(model_config.dtype)
    max_positions = model_config.max_model_len or cfg.max_position_embeddings
    with torch.device(state.device), _default_dtype(dtype):
        model = LlamaForCausalLM(cfg, state, dtype, flags, max_positions)
    model.load_weights(model_config.path)
    return model.eval()
