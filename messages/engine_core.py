"""Clients and the engine core: the messages between a front end (the LLM, an API server
process) and an engine core process, which runs the scheduler, the KV block manager and
the executor over its workers (docs/protocol.md, "Clients and the engine core").

A client connects a DEALER to the engine core's ROUTER and says EngineCoreHello; the
engine core answers EngineCoreReady once its workers are up. Requests and aborts go in;
outputs come out batched per step, one EngineCoreOutputs per client that has requests in
the step. Utility calls (health, stats, the admin calls) are matched by call id.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from messages.config import WorkerConfig
from messages.rpc import Value
from messages.sampling import SamplingParams
from messages.step import LogprobsLists

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class EngineCoreConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """What an engine core process is started with (the one message on its stdin): its
    workers' configuration, where it binds, and the token its clients' Hellos carry."""

    worker: WorkerConfig
    address: str  # where its ROUTER binds: ipc://PATH
    token: str
    engine_index: NonNegative = 0
    executor: Literal["mp", "ray"] = "mp"
    async_scheduling: bool = True
    enable_prefix_caching: bool = False
    step_timeout_s: float | None = 300.0
    vocab_size: int | None = None
    log_level: str = "WARNING"


class EngineCoreHello(msgspec.Struct, tag=True):
    """A client's first message: who it is (its process, and its index among the API
    servers; 0 for an LLM), and the token the engine core was started with."""

    protocol_version: int
    token: str
    pid: int
    client_index: NonNegative = 0


class EngineCoreReady(msgspec.Struct, tag=True):
    """The engine core's answer to a Hello, once its workers are up and warm: what a
    client checks its requests against, and the processes it runs."""

    engine_index: NonNegative
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    vocab_size: int | None
    num_workers: int  # tp x pp
    pid: int
    worker_pids: list[int] = []


class EngineCoreRequest(msgspec.Struct, tag=True):
    """A request to run. EOS ids, max_tokens, stop token ids and max_model_len end it in
    the engine core; stop strings are the client's (it aborts the request on one).
    arrival_time: the client's time.time() when the request came. shares_prompt_with:
    another request of this client with the same prompt (a sibling of an n > 1 request,
    sent before it): this one waits for that one's prompt to be computed, then takes its
    full prompt blocks instead of computing them again. sampling_params.n must be 1: the
    client fans n out into n requests."""

    request_id: str
    prompt_token_ids: np.ndarray  # int32 [n]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    shares_prompt_with: str | None = None


class AbortRequests(msgspec.Struct, tag=True):
    """Stop these requests and free their blocks. reason "abort": the client gave up on
    them (counted in num_aborted); "stop": the client found a stop string."""

    request_ids: list[str]
    reason: Literal["abort", "stop"] = "abort"


class EngineCoreOutput(msgspec.Struct, tag=True, omit_defaults=True):
    """What one step gave one request: its new tokens, and how it ended once finished
    (finish_reason "stop": an EOS or stop token, stop_reason its id; "length":
    max_tokens or max_model_len). logprobs: a row per new token when the request asked
    for them (column 0 the token itself, then the top ones)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | None = None
    logprobs: LogprobsLists | None = None
    num_cached_tokens: NonNegative = 0  # prefix-cache hits when it was scheduled
    # On a request's first output: seconds from the engine core taking it in to first
    # scheduling it (its own clock: a client cannot see either moment).
    queue_time_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class EngineCoreStats(msgspec.Struct, tag=True):
    """What an engine core holds now; counts since its start."""

    num_running: NonNegative
    num_waiting: NonNegative
    num_blocks: NonNegative
    num_free_blocks: NonNegative
    num_preemptions: NonNegative
    num_aborted: NonNegative  # requests its clients aborted before they finished
    # Tokens whose KV a prefill computed (prompts, and what a preempted request recomputes);
    # prefix-cache hits and prompt blocks shared by siblings are not computed.
    num_prefill_tokens: NonNegative = 0


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs for one client, with the engine core's stats after the step."""

    engine_index: NonNegative
    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats


class EngineCoreFailure(msgspec.Struct, tag=True):
    """These requests failed with this error (exc_type, message); fatal: the engine core
    cannot go on (its workers are gone) and stops after saying so."""

    engine_index: NonNegative
    request_ids: list[str]
    exc_type: str
    message: str
    fatal: bool = False


class WorkerCall(msgspec.Struct, tag=True):
    """A call of every worker (the collective_rpc utility): a worker RPC method with its
    arguments; timeout in seconds (None: the executor's bound)."""

    method: str
    args: list[Value] = []
    kwargs: dict[str, Value] = {}
    timeout: float | None = None


# A utility call's argument or result: an RPC value, or one of these.
UtilityValue = Value | EngineCoreStats | WorkerCall


class UtilityCall(msgspec.Struct, tag=True):
    """Call an engine core method of the utility allowlist between two steps; the answer
    is the UtilityResult with the same call_id."""

    call_id: int
    method: str
    args: list[UtilityValue] = []
    kwargs: dict[str, UtilityValue] = {}


class UtilityResult(msgspec.Struct, tag=True):
    """The answer to a UtilityCall: its result, or the error it raised."""

    call_id: int
    result: UtilityValue = None
    exc_type: str | None = None
    message: str = ""


EngineCoreMessage = (
    EngineCoreConfig
    | EngineCoreHello
    | EngineCoreReady
    | EngineCoreRequest
    | AbortRequests
    | EngineCoreOutputs
    | EngineCoreFailure
    | UtilityCall
    | UtilityResult
)
