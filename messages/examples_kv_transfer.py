"""Example messages of KV transfer (messages/kv_transfer.py), for the golden fixtures: a
prefill instance's step that stages a finished prefill's KV, a decode instance's step
that computes nothing and starts a pull, the reply that reports transfers over, a step
with host tier copies, and a pull between instances of two pipeline stages with a first
stage's reply.
Deterministic, like examples.py; block ids below its NUM_BLOCKS, handles its own."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from messages.example_stream import Stream, req_id
from messages.kinds import Message
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVFailure,
    KVHostCopies,
    KVLoad,
    KVSave,
    RemoteKV,
)
from messages.rpc import RpcReply, RpcRequest
from messages.sampling import SamplingParams
from messages.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

NUM_BLOCKS, BLOCK_SIZE = 4096, 16  # examples.py's cache
DEADLINE, LAST_RANK = 1_767_225_600.25, 1
PREFILL_ADDRESSES = ["tcp://10.0.0.7:47000"]  # the prefill's one tp rank
# A prefill of two pipeline stages (of one tp rank, as examples.py's run): rank r on
# port + r. Each stage's first rank answers a step's call.
STAGED_ADDRESSES = ["tcp://10.0.0.7:47000", "tcp://10.0.0.7:47001"]
STAGE_RANKS = [0, LAST_RANK]


def _blocks(rng: Stream, num_tokens: int) -> np.ndarray:
    return rng.distinct(-(-num_tokens // BLOCK_SIZE), NUM_BLOCKS)


def staging_step(seed: int = 11) -> SchedulerOutput:
    """Prefill side: two decodes go on while the prefill of request 9 (its first token
    came back last step, 700 prompt tokens) is staged for a decode instance."""
    rng = Stream(seed)
    cached = CachedRequestData.build([3, 5], [120, 64], [1, 1])
    save = KVSave(req_id(9), _blocks(rng, 700), num_tokens=700)
    return SchedulerOutput(
        [], cached, 2, finished_req_handles=[9], kv_connector_metadata=KVConnectorMetadata([save])
    )


def pull_step(seed: int = 12) -> SchedulerOutput:
    """Decode side, nothing to compute: the step carries a pull alone (its end is heard in
    a later step's output)."""
    rng = Stream(seed)
    # Its 44 blocks in the prefill's cache, as the prefill's engine staged them.
    remote = RemoteKV(req_id(9), 700, PREFILL_ADDRESSES, _blocks(Stream(11), 700))
    # Its first 12 blocks (a shared system prompt) are in this instance's prefix cache.
    load = KVLoad(req_id(9), _blocks(rng, 700), remote, num_cached_blocks=12)
    # A load the engine gave up on after a failed step, cancelled before this one starts.
    metadata = KVConnectorMetadata(loads=[load], cancel_loads=[req_id(8)])
    return SchedulerOutput([], CachedRequestData.empty(), 0, kv_connector_metadata=metadata)


def transfers_reply() -> ModelRunnerOutput:
    """A decode step's output that also reports one pull in and one that failed."""
    report = KVConnectorOutput(
        finished_recving=[req_id(9)],
        failed_recving=[KVFailure(req_id(10), f"no answer from {PREFILL_ADDRESSES[0]}")],
    )
    return ModelRunnerOutput(
        req_handles=np.array([3, 5], np.int32),
        sampled_token_ids=np.array([1012, 77], np.int32),
        kv_connector_output=report,
    )


def host_tier_step(seed: int = 13) -> SchedulerOutput:
    """A new request of 40 tokens whose first two blocks missed the device's prefix cache
    but were in the host tier (slots 5 and 6): loaded into its blocks 7 and 8, it
    computes the last 8 tokens. Blocks 7 and 9 held other cached blocks, which are stored
    (into slots 2 and 3) before anything overwrites them."""
    rng = Stream(seed)
    new = NewRequestData(
        req_id=req_id(14),
        req_handle=14,
        prompt_token_ids=rng.ints(40, 0, 32000),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=16),
        block_ids=np.array([7, 8, 9], np.int32),
        num_scheduled_tokens=8,
        num_computed_tokens=32,
        eos_token_ids=[2],
    )
    copies = KVHostCopies(
        store_blocks=np.array([7, 9], np.int32),
        store_slots=np.array([2, 3], np.int32),
        load_slots=np.array([5, 6], np.int32),
        load_blocks=np.array([7, 8], np.int32),
    )
    metadata = KVConnectorMetadata(host=copies)
    return SchedulerOutput([new], CachedRequestData.empty(), 8, kv_connector_metadata=metadata)


def staged_pull_step(seed: int = 15) -> SchedulerOutput:
    """Decode side of two pipeline stages (examples.py's run): request 9's pull from a
    prefill of two stages, each decode stage pulling from the prefill stage of its
    number."""
    rng = Stream(seed)
    remote = RemoteKV(req_id(9), 700, STAGED_ADDRESSES, pipeline_stages=2)
    load = KVLoad(req_id(9), _blocks(rng, 700), remote)
    metadata = KVConnectorMetadata(loads=[load])
    return SchedulerOutput([], CachedRequestData.empty(), 0, kv_connector_metadata=metadata)


def _execute(step: SchedulerOutput, call_id: int) -> RpcRequest:
    return RpcRequest(call_id, "execute_model", [step], deadline=DEADLINE, reply_rank=LAST_RANK)


KV_TRANSFER_EXAMPLES: dict[str, Callable[[], Message]] = {
    "request_kv_staging_step": lambda: _execute(staging_step(), 110),
    "request_kv_pull_step": lambda: _execute(pull_step(), 111),
    "reply_kv_transfers": lambda: RpcReply(112, LAST_RANK, result=transfers_reply()),
    "request_kv_host_tier_step": lambda: _execute(host_tier_step(), 113),
    "request_kv_staged_pull_step": lambda: RpcRequest(
        114, "execute_model", [staged_pull_step()], deadline=DEADLINE, reply_rank=STAGE_RANKS
    ),
    # The first stage's answer: its part of a pull ended (the engine reports the pull to
    # its scheduler once the last stage's output has it too).
    "reply_kv_stage_report": lambda: RpcReply(
        114, STAGE_RANKS[0], result=KVConnectorOutput(finished_recving=[req_id(9)])
    ),
}
