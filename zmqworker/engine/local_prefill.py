"""Which prompts a disaggregated router has computed on a decode instance rather than a
prefill instance: those of which at most max_local_prefill_tokens tokens are not cached
there already. Such a prompt costs a decode step little, less than a transfer's round
trip and a wait in a prefill instance's queue. Counting only what is not cached keeps a
conversation's next turn where its earlier turns are: the decode instance computes the
new tokens, where a prefill instance would wait its turn behind long prompts and compute
the last answer again (decoded on the decode instance, never seen there) before the new
tokens, whose KV then comes across.

What is cached is the router's estimate: the decode instance's block manager for the
in-process routers (disaggregated.py, threaded_router.py), the prompts sent there and
the answers that ended there for the client's (frontend/disaggregated_client.py:
prefix_affinity.py, decoded_tokens.py). The client's router sends the limit with the
request (KVTransferParams.max_uncached_tokens), and the decode instance refuses it unrun
where more is uncached in its own cache when it first schedules it (Request.declines):
a wrong estimate costs a round trip, never a long prefill among the decodes, nor a
token."""

from __future__ import annotations


def local_prefill_limit(max_local_prefill_tokens: int | None) -> int:
    """The most uncached prompt tokens computed on a decode instance (0: none) for the
    option's value (None: none); ValueError naming a value below 1."""
    if max_local_prefill_tokens is None:
        return 0
    if max_local_prefill_tokens < 1:
        raise ValueError(
            f"max_local_prefill_tokens must be at least 1, got {max_local_prefill_tokens}"
        )
    return max_local_prefill_tokens


def computes_locally(num_tokens: int, num_cached: int, limit: int) -> bool:
    """Whether a prompt of num_tokens, num_cached of them cached on a decode instance, is
    computed there under limit (local_prefill_limit's)."""
    return limit > 0 and num_tokens - num_cached <= limit
