"""Llama-family models over the paged KV cache, their weight loading and the embedded
default checkpoint."""

from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.registry import ARCHITECTURES, CausalLM, build_model, load_hf_config

__all__ = ["ARCHITECTURES", "CausalLM", "LlamaForCausalLM", "build_model", "load_hf_config"]
