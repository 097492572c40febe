"""The n samples of one prompt share its KV: the client sends them as n requests, each
but the first naming the first as the one it shares its prompt with. The first computes
the prompt; each other one waits while the first is running until that is done (in an
earlier step: a step's workers may read its context before they write its keys; a first
one not running, preempted behind it, is not waited for), then takes the first one's
full prompt blocks, referenced twice in the block manager, and computes only the rest
of the prompt itself: the last, partial block and at least the last token, which it
samples from. Recomputing that part (under a block of tokens per sample) costs less
than copying a block on every layer of every worker, which the worker protocol would
need a new call for; and it works with the prefix cache off.

A shared block is never written again: later tokens go to positions past it. Blocks
computed before a reset of the prefix cache (new weights) are not shared: a sample
that starts after it computes its prompt with the new weights.

A request that asks for prompt logprobs computes its whole prompt (every position's
logprobs), sharing nothing; the client asks them of the first sample only, so the
others share its blocks as without them.
"""

from __future__ import annotations

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.request import Request, RequestStatus
from zmqworker.engine.running import RunningTable


def computed_prompt_blocks(
    request: Request, requests: dict[str, Request], table: RunningTable, kv: KVBlockManager
) -> tuple[list[int], list[int], int] | None:
    """(blocks, host slots, tokens) a waiting request starts from (none for one that
    asks for prompt logprobs): a remote prefill's loaded tokens, in blocks it holds
    already; its sibling's full prompt blocks, else the prefix cache's hits
    (get_computed_blocks) and the host tier's after them (get_host_hits, loaded into its
    first new blocks); None while the sibling's prompt is not computed yet (the request
    waits). Read while a step is drafted: a sibling's computed tokens (its table's
    count) are those of the steps before it only."""
    if request.num_loaded_tokens:
        return [], [], request.num_loaded_tokens
    if request.sampling_params.prompt_logprobs is not None:
        return [], [], 0  # every prompt position computed, for its logprobs (as vLLM)
    num_blocks = (len(request.prompt_token_ids) - 1) // kv.block_size
    name = request.shares_prompt_with
    sibling = requests.get(name) if name is not None else None
    if (
        sibling is None
        or num_blocks == 0
        or request.output_token_ids  # a restart: its outputs are part of its prompt now
        or sibling.prompt_token_ids != request.prompt_token_ids
        # Waiting behind this one (both preempted, this one last: it goes first) or gone:
        # waiting for it would hold the queue's head for ever.
        or sibling.status is not RequestStatus.RUNNING
        # Its prompt's KV is from before new weights: this one computes its own.
        or kv.holds_stale_kv(sibling.req_id)
    ):
        blocks, num_tokens = kv.get_computed_blocks(request.req_id, request.all_token_ids)
        slots = kv.get_host_hits(request.req_id, request.all_token_ids, len(blocks))
        return blocks, slots, num_tokens + len(slots) * kv.block_size
    num_tokens = num_blocks * kv.block_size
    if table.computed_of(sibling) < num_tokens:
        return None
    return kv.block_ids(sibling.req_id)[:num_blocks], [], num_tokens
