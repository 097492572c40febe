"""The scheduler's checks on what it is given: its limits at construction, and each
request as it is added, each failing with an error that names what is wrong."""

from __future__ import annotations

from typing import Protocol

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.request import Request, RequestStatus


class Limits(Protocol):
    """The scheduler's settings (the scheduler imports this module)."""

    kv: KVBlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    send_token_ids: bool
    max_concurrent_batches: int
    async_scheduling: bool


def check_limits(scheduler: Limits) -> None:
    """The scheduler's settings, checked as it is made."""
    block_manager, max_model_len = scheduler.kv, scheduler.max_model_len
    max_concurrent_batches = scheduler.max_concurrent_batches
    for name, value in (
        ("max_num_seqs", scheduler.max_num_seqs),
        ("max_concurrent_batches", max_concurrent_batches),
        ("max_num_batched_tokens", scheduler.max_num_batched_tokens),
        ("max_model_len", max_model_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if scheduler.async_scheduling and (scheduler.send_token_ids or max_concurrent_batches < 2):
        raise ValueError(
            "async_scheduling keeps steps in flight on one pipeline stage: "
            f"max_concurrent_batches must be 2 or more (got {max_concurrent_batches}) "
            "and send_token_ids off"
        )
    capacity = block_manager.num_blocks * block_manager.block_size
    if capacity < max_model_len:
        # A request of max_model_len tokens could never fit, even alone.
        raise ValueError(
            f"the KV cache holds {block_manager.num_blocks} blocks of "
            f"{block_manager.block_size} tokens ({capacity} tokens), fewer than "
            f"max_model_len={max_model_len}: give the workers more KV cache memory "
            "or lower max_model_len"
        )


def check_new_request(request: Request, max_model_len: int, has_kv_connector: bool) -> None:
    """A request about to be added (not a duplicate: the scheduler checks that)."""
    num_given = 0 if request.remote is None else 1  # the remote prefill's token
    if request.status is not RequestStatus.WAITING or len(request.output_token_ids) > num_given:
        raise ValueError(f"request {request.req_id!r} is not a fresh request")
    if (request.remote or request.remote_decode) and not has_kv_connector:
        raise ValueError(
            f"request {request.req_id!r} takes part in KV transfer, but this engine has "
            "no KV connector (give its workers a kv_transfer config)"
        )
    if request.num_tokens > max_model_len:
        raise ValueError(
            f"request {request.req_id!r}: prompt of {request.num_tokens} tokens is longer "
            f"than max_model_len={max_model_len}"
        )
