"""Canonical example messages between clients and an engine core (the golden fixtures of
docs/protocol.md, "Clients and the engine core"). Deterministic, as messages/examples.py:
a fixture's bytes change only when a schema does."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from messages.config import ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from messages.engine_core import (
    AbortRequests,
    EngineCoreConfig,
    EngineCoreFailure,
    EngineCoreHello,
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStats,
    FinishedOutput,
    FirstOutput,
    KVTransferParams,
    RequestLogprobs,
    RequestPromptLogprobs,
    UtilityCall,
    UtilityResult,
    WorkerCall,
)
from messages.example_stream import Stream, req_id
from messages.kv_transfer import RemoteKV
from messages.sampling import SamplingParams
from messages.step import LogprobsLists
from messages.structured_outputs import StructuredOutputsParams
from messages.version import PROTOCOL_VERSION

VOCAB_SIZE = 49_152  # SmolLM2's
EOS = 2  # SmolLM2-Instruct's <|im_end|>
TOKEN = "5d0c9e1a7b3f48e2a6c14f0b9d2e7a31"  # an engine core's client token, 32 hex digits
ARRIVAL = 1_767_225_600.125  # a fixed instant: fixtures must not depend on the clock
ADDRESS = "ipc:///tmp/zmqworker-core-r4m8t2vq/engine-core-1.sock"
STATS = EngineCoreStats(
    num_running=250, num_waiting=6, num_blocks=40_960, num_free_blocks=12_288,
    num_preemptions=3, num_aborted=1,
)  # fmt: skip


def engine_core_config() -> EngineCoreConfig:
    """Replica 1 of two (data parallel), SmolLM2-135M in bfloat16 on CUDA."""
    worker = WorkerConfig(
        model=ModelConfig(
            path="/models/SmolLM2-135M-Instruct", dtype="bfloat16", max_model_len=4096
        ),
        parallel=ParallelConfig(data_parallel_size=2, data_parallel_rank=1),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
    )
    return EngineCoreConfig(
        worker=worker,
        address=ADDRESS,
        token=TOKEN,
        engine_index=1,
        vocab_size=VOCAB_SIZE,
        log_level="INFO",
    )


def engine_core_request(prompt_len: int = 130, seed: int = 10) -> EngineCoreRequest:
    """A chat completion's request: greedy, a stop string (the client's to find), top-2
    logprobs. Its prompt ids travel inline up to 4,096 tokens, in a data frame above."""
    rng = Stream(seed)
    params = SamplingParams(temperature=0.0, max_tokens=256, stop=["\n\n"], logprobs=2)
    return EngineCoreRequest(
        request_id=req_id(1000 + prompt_len),
        prompt_token_ids=rng.ints(prompt_len, 0, VOCAB_SIZE),
        sampling_params=params,
        eos_token_ids=[EOS],
        arrival_time=ARRIVAL,
    )


def structured_request(seed: int = 14) -> EngineCoreRequest:
    """A request whose output a JSON schema constrains (the schema travels as JSON text)."""
    schema = '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}'
    params = SamplingParams(
        temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)
    )
    return EngineCoreRequest(
        request_id=req_id(1014),
        prompt_token_ids=Stream(seed).ints(12, 0, VOCAB_SIZE),
        sampling_params=params,
        eos_token_ids=[EOS],
        arrival_time=ARRIVAL,
    )


def rollout_request(seed: int = 16) -> EngineCoreRequest:
    """An RL rollout's request: token ids only (detokenize false: the client decodes no
    text), its prompt cut by the client to the last 24 tokens (truncate_prompt_tokens)."""
    params = SamplingParams(
        seed=7, max_tokens=128, logprobs=0, detokenize=False, truncate_prompt_tokens=24
    )
    return EngineCoreRequest(
        request_id=req_id(1016),
        prompt_token_ids=Stream(seed).ints(24, 0, VOCAB_SIZE),
        sampling_params=params,
        eos_token_ids=[EOS],
        arrival_time=ARRIVAL,
    )


# Where a prefill instance's tp rank 0 serves its staged KV (disaggregated serving).
PREFILL_KV = RemoteKV(
    req_id(1040), 40, ["tcp://127.0.0.1:47000"], np.array([812, 813, 97], np.int32),
    weights_version=3,
)  # fmt: skip


def disaggregated_request(params: KVTransferParams) -> EngineCoreRequest:
    """A request of disaggregated serving: to the prefill instance (do_remote_decode), to
    the decode instance with the prefill's first token and where its KV waits, or to the
    decode instance to compute itself (max_uncached_tokens)."""
    return EngineCoreRequest(
        request_id=req_id(1040),
        prompt_token_ids=Stream(15).ints(40, 0, VOCAB_SIZE),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=64),
        eos_token_ids=[EOS],
        arrival_time=ARRIVAL,
        kv_transfer_params=params,
    )


def prefill_outputs() -> EngineCoreOutputs:
    """A prefill instance's step: the request's first token, and its end there with where
    its KV waits for the decode instance."""
    return EngineCoreOutputs(
        engine_index=0,
        request_ids=[req_id(1040)],
        new_token_ids=np.array([9_001], np.int32),
        stats=STATS,
        finished=[FinishedOutput(0, "length", kv_transfer=PREFILL_KV)],
        first=[FirstOutput(0, 0, 0.004)],
    )


def decode_outputs(num_reqs: int = 256, seed: int = 11) -> EngineCoreOutputs:
    """A decode step's outputs for one client: a token each (no offsets); one request
    ends on EOS, one at max_tokens."""
    rng = Stream(seed)
    tokens = rng.ints(num_reqs, 3, VOCAB_SIZE)
    tokens[7] = EOS
    return EngineCoreOutputs(
        engine_index=1,
        request_ids=[req_id(i) for i in range(num_reqs)],
        new_token_ids=tokens,
        stats=STATS,
        finished=[FinishedOutput(7, "stop", EOS), FinishedOutput(9, "length")],
    )


def logprobs_outputs(seed: int = 12) -> EngineCoreOutputs:
    """Three requests' outputs: the first two's first tokens with top-2 logprobs (a row
    each, the token first; the second had 64 prompt tokens from the prefix cache), the
    third's two tokens (two steps came back at once: offsets)."""
    rng = Stream(seed)
    ids = rng.ints((2, 3), 0, VOCAB_SIZE)
    values = -np.sort(rng.floats((2, 3), 0.0, 8.0), axis=1)
    tokens = np.concatenate([ids[:, 0], rng.ints(2, 0, VOCAB_SIZE)]).astype(np.int32)

    def rows(i: int) -> LogprobsLists:
        return LogprobsLists(ids[i : i + 1], values[i : i + 1], np.array([1 + i], np.int32))

    return EngineCoreOutputs(
        engine_index=0,
        request_ids=[req_id(20), req_id(21), req_id(22)],
        new_token_ids=tokens,
        stats=STATS,
        token_offsets=np.array([0, 1, 2, 4], np.int32),
        first=[FirstOutput(0, 0, 0.002), FirstOutput(1, 64, 0.015)],
        logprobs=[RequestLogprobs(0, rows(0)), RequestLogprobs(1, rows(1))],
    )


def prompt_logprobs_outputs(seed: int = 15) -> EngineCoreOutputs:
    """A request's first token with the top-1 prompt logprobs of its 5-token prompt: a
    row per position after the first, the prompt token first (of rank 1 in the last)."""
    rng = Stream(seed)
    ids = rng.ints((4, 2), 0, VOCAB_SIZE).astype(np.int32)
    values = -np.sort(rng.floats((4, 2), 0.0, 8.0), axis=1)[:, ::-1].astype(np.float32)
    ids[3, 0], values[3, 0] = ids[3, 1], values[3, 1]
    ranks = np.array([5, 2, 17, 1], np.int32)
    return EngineCoreOutputs(
        engine_index=0,
        request_ids=[req_id(30)],
        new_token_ids=rng.ints(1, 0, VOCAB_SIZE).astype(np.int32),
        stats=STATS,
        first=[FirstOutput(0, 0, 0.001)],
        prompt_logprobs=[RequestPromptLogprobs(0, LogprobsLists(ids, values, ranks))],
    )


def worker_death() -> EngineCoreFailure:
    return EngineCoreFailure(
        engine_index=1,
        request_ids=[req_id(i) for i in range(3)],
        exc_type="WorkerDiedError",
        message="worker rank 1 died (killed by SIGKILL, exit status -9)",
        fatal=True,
    )


# name -> builder, in the order of a client's life: hello, requests, outputs, utilities.
ENGINE_CORE_EXAMPLES: dict[str, Callable[[], EngineCoreMessage]] = {
    "engine_core_config": engine_core_config,
    "engine_core_hello": lambda: EngineCoreHello(
        protocol_version=PROTOCOL_VERSION, token=TOKEN, pid=48300, client_index=2
    ),
    "engine_core_ready": lambda: EngineCoreReady(
        engine_index=1,
        max_model_len=4096,
        num_blocks=40_960,
        block_size=16,
        max_num_seqs=256,
        vocab_size=VOCAB_SIZE,
        num_workers=1,
        pid=48301,
        worker_pids=[48302],
        kv_role="consumer",
        prefix_caching=True,
        host_id="3f2c9a4e-8d1b-4c6a-9e7f-51b2d0a4c8e6",
    ),  # fmt: skip
    "engine_core_request": engine_core_request,
    "engine_core_request_long": lambda: engine_core_request(prompt_len=8192, seed=13),
    "engine_core_request_structured": structured_request,
    "engine_core_request_rollout": rollout_request,
    "engine_core_request_prefill": lambda: disaggregated_request(
        KVTransferParams(do_remote_decode=True)
    ),
    "engine_core_request_decode": lambda: disaggregated_request(
        KVTransferParams(remote=PREFILL_KV, first_token=9_001)
    ),
    "engine_core_request_local": lambda: disaggregated_request(
        KVTransferParams(max_uncached_tokens=8)
    ),
    "abort_requests": lambda: AbortRequests([req_id(3), req_id(5)]),
    "abort_requests_stop": lambda: AbortRequests([req_id(4)], reason="stop"),
    "engine_core_outputs_decode_256": decode_outputs,
    "engine_core_outputs_logprobs": logprobs_outputs,
    "engine_core_outputs_prefill": prefill_outputs,
    "engine_core_outputs_prompt_logprobs": prompt_logprobs_outputs,
    "engine_core_failure_request": lambda: EngineCoreFailure(
        engine_index=0,
        request_ids=[req_id(6)],
        exc_type="ValueError",
        message="logprobs=30 is more than max_logprobs=20",
    ),
    "engine_core_failure_worker_death": worker_death,
    "utility_call_stats": lambda: UtilityCall(call_id=1, method="stats"),
    "utility_result_stats": lambda: UtilityResult(call_id=1, result=STATS),
    "utility_call_collective_rpc": lambda: UtilityCall(
        call_id=2,
        method="collective_rpc",
        args=[WorkerCall("echo", args=[3, "text"], kwargs={"limit": 10}, timeout=30.0)],
    ),
    "utility_result_error": lambda: UtilityResult(
        call_id=3,
        exc_type="AttributeError",
        message="'sleeep' is not an engine core utility; those are check_health, "
        "collective_rpc, init_weight_transfer_group, is_sleeping, not_ready, reload_weights, "
        "reset_prefix_cache, sleep, stats, update_weights_from_group, wake_up, weights_updated",
    ),
}
