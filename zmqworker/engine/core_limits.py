"""The largest frames the engine core's sockets and its clients' take in (ZMQ_MAXMSGSIZE):
a peer that sends more is disconnected before the frame is read."""

from __future__ import annotations

from dataclasses import dataclass

from messages import WorkerConfig
from zmqworker.executor.message_limits import BODY_ROOM, message_limits

# Utility calls (an update's announcement, a worker call's arguments) need room beyond a
# step's sizes.
UTILITY_ROOM = 64 << 20
OUTPUT_ROOM = 512  # per request of a step: its id, counts and finish


@dataclass(frozen=True)
class EngineCoreLimits:
    input_bytes: int  # the engine core's ROUTER: requests, aborts, utility calls
    output_bytes: int  # a client's DEALER: one step's outputs for it, utility results


def engine_core_limits(config: WorkerConfig) -> EngineCoreLimits:
    run = message_limits(config)
    # A step's logprobs: ids and values (4 bytes each) where a worker reply has ids alone.
    logprobs = 2 * (run.reply_bytes - BODY_ROOM)
    outputs = logprobs + config.scheduler.max_num_seqs * OUTPUT_ROOM
    return EngineCoreLimits(
        input_bytes=max(run.request_bytes, UTILITY_ROOM),
        output_bytes=max(outputs + BODY_ROOM, run.prompt_logprobs_bytes, UTILITY_ROOM),
    )
