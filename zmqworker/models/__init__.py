"""Llama-family models over the paged KV cache: the layers (plain torch and fused
Triton), weight loading (or dummy weights) and the embedded default checkpoint.

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.distributed.
"""

from zmqworker.models.llama import LlamaForCausalLM
from zmqworker.models.registry import CausalLM, build_model, load_hf_config

__all__ = ["CausalLM", "LlamaForCausalLM", "build_model", "load_hf_config"]
