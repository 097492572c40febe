"""Clients and the engine core: the messages between a front end (the LLM, an API server
process) and an engine core process, which runs the scheduler, the KV block manager and
the executor over its workers (docs/protocol.md, "Clients and the engine core").

A client connects a DEALER to the engine core's ROUTER and says EngineCoreHello; the
engine core answers EngineCoreReady once its workers are up. Requests and aborts go in;
outputs come out batched per step, one EngineCoreOutputs per client that has requests in
the step (one with no requests is a load report: the stats alone). Utility calls
(health, stats, the admin calls) are matched by call id.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from messages.config import WorkerConfig
from messages.kv_transfer import RemoteKV
from messages.rpc import Value
from messages.sampling import SamplingParams, TokenId
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
    # Its workers' KV transfer role (KVTransferConfig.role): "producer" for a prefill
    # instance, "consumer" for a decode instance; "" without KV transfer.
    kv_role: Literal["", "producer", "consumer", "both"] = ""
    # Whether it keeps a prefix cache: only then does a client send prompts that share a
    # prefix to the engine core that was sent it before.
    prefix_caching: bool = False
    # The boot id of the host it runs on (its multiproc workers' too; "" unknown): a router
    # hands a prefill's KV to a decode instance of the same host where it can, since the
    # KV can move through shared memory there rather than over tcp.
    host_id: str = ""


class KVTransferParams(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """A request's part in disaggregated serving. do_remote_decode (to a prefill
    instance): finish after the first token and keep the prompt's KV staged for a decode
    instance; its FinishedOutput then says where (kv_transfer). remote and first_token (to
    a decode instance): the prompt's KV waits there, the prefill sampled first_token;
    this instance pulls the KV and decodes from the second token on.
    max_uncached_tokens (to a decode instance, the prompt computed there): run it only if
    at most this many of its prompt tokens are not cached there when it is first
    scheduled; else it fails unrun (EngineCoreFailure, PROMPT_NOT_CACHED), for the
    client to send to a prefill instance."""

    do_remote_decode: bool = False
    remote: RemoteKV | None = None
    first_token: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_uncached_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        local = self.max_uncached_tokens is not None
        if [self.do_remote_decode, self.remote is not None, local].count(True) != 1:
            raise ValueError(
                "kv_transfer_params: give do_remote_decode (to a prefill instance), remote "
                "or max_uncached_tokens (to a decode instance), one of the three"
            )
        if (self.remote is None) != (self.first_token is None):
            raise ValueError("kv_transfer_params: remote and first_token go together")


class EngineCoreRequest(msgspec.Struct, tag=True):
    """A request to run. EOS ids, max_tokens, stop token ids and max_model_len end it in
    the engine core; stop strings are the client's (it aborts the request on one).
    arrival_time: the client's time.time() when the request came. shares_prompt_with:
    another request of this client with the same prompt (a sibling of an n > 1 request,
    sent before it): this one waits for that one's prompt to be computed, then takes its
    full prompt blocks instead of computing them again. sampling_params.n must be 1: the
    client fans n out into n requests. kv_transfer_params: its part in disaggregated
    serving (None: computed and decoded here)."""

    request_id: str
    prompt_token_ids: np.ndarray  # int32 [n]
    sampling_params: SamplingParams
    eos_token_ids: list[TokenId] = []
    arrival_time: float = 0.0
    shares_prompt_with: str | None = None
    kv_transfer_params: KVTransferParams | None = None


class AbortRequests(msgspec.Struct, tag=True):
    """Stop these requests and free their blocks. reason "abort": the client gave up on
    them (counted in num_aborted); "stop": the client found a stop string."""

    request_ids: list[str]
    reason: Literal["abort", "stop"] = "abort"


class FinishedOutput(msgspec.Struct, tag=True, omit_defaults=True):
    """A request of the step that ended: its position among the step's request_ids, and
    how (finish_reason "stop": an EOS or stop token, stop_reason its id; "length":
    max_tokens or max_model_len). kv_transfer: a request sent with do_remote_decode that
    goes on elsewhere (finish_reason "length"): where its prompt's KV waits."""

    index: NonNegative
    finish_reason: Literal["stop", "length"]
    stop_reason: int | None = None
    kv_transfer: RemoteKV | None = None


class FirstOutput(msgspec.Struct, tag=True, omit_defaults=True):
    """A request's first output (its position among the step's request_ids): prefix-cache
    hits when it was scheduled, and seconds from the engine core taking it in to first
    scheduling it (the engine core's clock: a client cannot see either moment)."""

    index: NonNegative
    num_cached_tokens: NonNegative = 0
    queue_time_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class RequestLogprobs(msgspec.Struct, tag=True, omit_defaults=True):
    """The logprobs of a request that asked for them (its position among the step's
    request_ids): a row per new token, column 0 the token itself, then the top ones."""

    index: NonNegative
    rows: LogprobsLists


class RequestPromptLogprobs(msgspec.Struct, tag=True, omit_defaults=True):
    """The prompt logprobs of a request that asked for them (its position among the
    step's request_ids), with its first output: a row per prompt position after the
    first (prompt length - 1 rows), column 0 the prompt's token, then the top ones."""

    index: NonNegative
    rows: LogprobsLists


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
    # The host KV tier (kv_offloading_size; zeros without one): its slots, those holding a
    # block now, and since start the blocks stored into it, loaded back from it on a
    # prefix hit, and evicted from the device with no slot free to take them (dropped).
    num_host_blocks: NonNegative = 0
    num_host_blocks_used: NonNegative = 0
    num_host_stored_blocks: NonNegative = 0
    num_host_loaded_blocks: NonNegative = 0
    num_host_dropped_blocks: NonNegative = 0
    # A disaggregated decode instance, since start, over the requests whose remote KV came
    # in: their prompt blocks found here already (prefix cache or host tier), and those
    # pulled from the prefill instance.
    num_remote_hit_blocks: NonNegative = 0
    num_remote_pulled_blocks: NonNegative = 0


class EngineCoreOutputs(msgspec.Struct, tag=True, omit_defaults=True):
    """One step's outputs for one client, as columns: the requests that got tokens or
    ended, each once, and their new tokens one after the other (request i's are
    new_token_ids[token_offsets[i]:token_offsets[i + 1]]; without token_offsets, one
    token each, the decode step's common case). What only some requests have is sparse,
    by position in request_ids, in increasing order: how those that ended did, the first
    outputs' prefix-cache hits and queue times, logprobs, prompt logprobs (with a first
    output). stats: the engine core after the step. With no request_ids, a load report:
    the engine core's stats now, sent to a client that last heard another load."""

    engine_index: NonNegative
    request_ids: list[str]
    new_token_ids: np.ndarray  # int32 [total new tokens]
    stats: EngineCoreStats
    token_offsets: np.ndarray | None = None  # int32 [len(request_ids) + 1]
    finished: list[FinishedOutput] = []
    first: list[FirstOutput] = []
    logprobs: list[RequestLogprobs] = []
    prompt_logprobs: list[RequestPromptLogprobs] = []

    def __post_init__(self) -> None:
        """Untrusted columns: every length, offset and position must agree (a decoder
        raises, naming what did not)."""
        n, tokens = len(self.request_ids), self.new_token_ids
        _check_ints("new_token_ids", tokens)
        if len(tokens) and tokens.min() < 0:
            raise ValueError(f"new_token_ids holds {tokens.min()}: token ids are >= 0")
        offsets = self.token_offsets
        if offsets is None:
            if len(tokens) != n:
                raise ValueError(
                    f"{len(tokens)} new_token_ids for {n} request_ids without token_offsets "
                    "(one token each)"
                )
        else:
            _check_ints("token_offsets", offsets)
            # Checked as int64: an unsigned column's differences (uint8's) wrap, never < 0.
            offsets = offsets.astype(np.int64, copy=False)
            if len(offsets) != n + 1:
                raise ValueError(f"{len(offsets)} token_offsets for {n} request_ids: needs {n + 1}")
            if offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any():
                raise ValueError(
                    f"token_offsets must rise from 0 to {len(tokens)} (the new_token_ids), got "
                    f"{offsets[0]} to {offsets[-1]}"
                    + (" going down" if (np.diff(offsets) < 0).any() else "")
                )
        if len(set(self.request_ids)) != n:
            twice = next(i for i in self.request_ids if self.request_ids.count(i) > 1)
            raise ValueError(f"request id {twice!r} is in request_ids twice")
        for name in ("finished", "first", "logprobs", "prompt_logprobs"):
            last = -1
            for entry in getattr(self, name):
                if not last < entry.index < n:
                    raise ValueError(
                        f"{name} index {entry.index} after {last}: positions among the {n} "
                        "request_ids, in increasing order"
                    )
                last = entry.index
        for entry in self.logprobs:
            i = entry.index
            count = 1 if offsets is None else int(offsets[i + 1] - offsets[i])
            _check_rows(f"logprobs of {self.request_ids[i]!r}", entry.rows, count)
        for prompt in self.prompt_logprobs:
            name = f"prompt logprobs of {self.request_ids[prompt.index]!r}"
            _check_rows(name, prompt.rows, len(prompt.rows.logprob_token_ids), at_least=0)


def _check_ints(name: str, values: np.ndarray) -> None:
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"{name} must be one row of integers, got {values.dtype}{list(values.shape)}"
        )


def _check_rows(name: str, rows: LogprobsLists, count: int, at_least: int = 1) -> None:
    """count (at least at_least) rows: ids and logprobs [count, k + 1] alike, a rank each."""
    ids, values, ranks = rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks
    if ids.ndim != 2 or ids.shape != values.shape or ranks.shape != (len(ids),):
        raise ValueError(
            f"{name}: token ids {list(ids.shape)}, logprobs {list(values.shape)} and ranks "
            f"{list(ranks.shape)} do not make rows"
        )
    if len(ids) != count or len(ids) < at_least or ids.shape[1] < 1:
        raise ValueError(f"{name}: {len(ids)} rows of {ids.shape[1]} for {count} new token(s)")


# The exc_type of a request sent with kv_transfer_params.max_uncached_tokens that was
# not run: more of its prompt than that was not cached on that engine core.
PROMPT_NOT_CACHED = "PromptNotCached"


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
