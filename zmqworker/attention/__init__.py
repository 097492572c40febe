"""Paged attention over a block-table KV cache, and the per-step metadata it reads.

The function lives at zmqworker.attention.paged_attention.paged_attention; it is not
re-exported here so that the submodule name stays importable as a module.
"""

from zmqworker.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionMetadata", "build_attention_metadata"]
