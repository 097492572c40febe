"""The scheduler's checks on what it is given: its limits at construction, and each
request as it is added, each failing with an error that names what is wrong."""

from __future__ import annotations

from typing import Protocol

from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.kv_connector import KVConnectorScheduler
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


def check_new_request(
    request: Request, max_model_len: int, kv: KVConnectorScheduler | None
) -> None:
    """A request about to be added (not a duplicate of a live one: the scheduler checks
    that). kv: this engine's KV transfer, whose role says what it takes (a decode
    instance pulls, a prefill instance serves), so that a request sent to the wrong side
    of a pair is refused before it runs, and which refuses an id whose blocks it holds."""
    pulls_kv, serves_kv = kv is not None and kv.consumes, kv is not None and bool(kv.addresses)
    num_given = 0 if request.remote is None else 1  # the remote prefill's token
    if request.status is not RequestStatus.WAITING or len(request.output_token_ids) > num_given:
        raise ValueError(f"request {request.req_id!r} is not a fresh request")
    if kv is not None and kv.holds(request.req_id):
        raise ValueError(
            f"request id {request.req_id!r} still holds blocks here, its KV transfer not "
            "over: send it again once its transfer has ended or timed out, or use a new id"
        )
    if request.remote is not None and not pulls_kv:
        raise ValueError(
            f"request {request.req_id!r} brings a remote prefill's KV, but this engine pulls "
            "none (its workers' kv_transfer role is not a consumer: is it a decode instance?)"
        )
    if request.remote_decode and not serves_kv:
        raise ValueError(
            f"request {request.req_id!r} asks for a remote decode, but this engine serves no "
            "KV (its workers' kv_transfer role is not a producer: is it a prefill instance?)"
        )
    if request.num_tokens > max_model_len:
        raise ValueError(
            f"request {request.req_id!r}: prompt of {request.num_tokens} tokens is longer "
            f"than max_model_len={max_model_len}"
        )
