"""The plain-torch attention's gather workspace: blocks of the paged cache copied out in
order, for SDPA over a request's history.

One flat buffer per (device, dtype), grown on demand and reused across layers and steps:
fresh multi-megabyte buffers per layer cost page faults that show on the CPU. The model
runner owns the workspace and hands it to the attention with each step's metadata.
"""

from __future__ import annotations

import torch

from zmqworker.cdiv import cdiv

_ROUND = 1 << 20  # elements; growth granularity


class GatherWorkspace:
    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def release(self) -> None:
        """Free the buffers (before sleeping, or measuring memory)."""
        self._buffers.clear()

    def gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks (int64 [n]) in order, each [num_kv_heads,
        n * block_size, head_dim]: views of the buffer, which the next gather overwrites."""
        num_kv_heads = kv_cache.shape[2]
        block_size = kv_cache.shape[3] // head_dim
        n = block_ids.numel()
        elems = n * num_kv_heads * block_size * head_dim
        key = (kv_cache.device, kv_cache.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < 3 * elems:
            size = cdiv(3 * elems, _ROUND) * _ROUND
            # A normal tensor, not an inference one: steps run with and without inference mode.
            with torch.inference_mode(False):
                buf = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
            self._buffers[key] = buf
        staged = buf[:elems]
        out = buf[elems : 3 * elems].view(2, num_kv_heads, n, block_size, head_dim)
        # Whole blocks first (row copies, near memcpy speed), then one reordering copy: an
        # index_select across the heads dimension would copy the whole cache.
        blocks = staged.view(n, num_kv_heads, block_size * head_dim)
        torch.index_select(kv_cache[0], 0, block_ids, out=blocks)
        out[0].copy_(blocks.view(n, num_kv_heads, head_dim, block_size).permute(1, 0, 3, 2))
        torch.index_select(kv_cache[1], 0, block_ids, out=blocks)
        out[1].copy_(blocks.view(n, num_kv_heads, block_size, head_dim).transpose(0, 1))
        history = out.view(2, num_kv_heads, n * block_size, head_dim)
        return history[0], history[1]
