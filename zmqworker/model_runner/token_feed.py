"""The token feed on the device: a step's input ids that the previous step sampled are
read from its sampled ids where they already are, without a round trip through the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zmqworker.pdl import launch_options, release_dependents, wait_for_inputs

_BLOCK = 256


@triton.jit(do_not_specialize=["num_tokens"])  # one compile whatever the step's size
def _feed_kernel(
    input_ids_ptr, feed_index_ptr, sampled_ptr, num_tokens, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_inputs(PDL)
    release_dependents(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_tokens
    index = tl.load(feed_index_ptr + offs, mask=ok, other=-1)
    fed = ok & (index >= 0)
    token = tl.load(sampled_ptr + index, mask=fed, other=0)
    tl.store(input_ids_ptr + offs, token, mask=fed)


def feed_tokens(input_ids: torch.Tensor, feed_index: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids[t] = sampled[feed_index[t]] where feed_index[t] >= 0 (all int32)."""
    n = input_ids.numel()
    if n:
        _feed_kernel[(triton.cdiv(n, _BLOCK),)](
            input_ids, feed_index, sampled, n, BLOCK=_BLOCK, **launch_options(input_ids.device)
        )
