"""Paged attention over a block-table KV cache: the cache layout, the plain-torch path
(the CPU's) and the Triton kernels (CUDA's), and the per-step metadata each reads.

May import: messages, zmqworker.transport, zmqworker.cdiv. The functions live in their
modules (paged_attention, triton_attention); they are not re-exported here, so that the
submodule names stay importable as modules.
"""

from zmqworker.attention.metadata import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionMetadata", "build_attention_metadata"]
