"""Canonical example messages, and an exact comparison for them.

The golden fixtures (messages/make_fixtures.py), the codec tests and the serialization
benchmark all build their messages here. Every builder is deterministic (seeded
generators, no clocks, no uuid4), so a fixture's bytes change only when a schema does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from messages.example_stream import Stream, req_id
from messages.examples_engine_core import ENGINE_CORE_EXAMPLES
from messages.examples_kv_transfer import KV_TRANSFER_EXAMPLES
from messages.examples_start import BLOCK_SIZE, RUN_ID, hello, kv_cache_spec, welcome
from messages.examples_weights import WEIGHT_EXAMPLES
from messages.kinds import Message
from messages.kv_cache import make_kv_cache_config
from messages.rpc import (
    Ping,
    PipelineSharedTensors,
    PipelineStepRefused,
    PipelineTensors,
    RemoteError,
    RpcReply,
    RpcRequest,
    SharedSlot,
    SharedTensorRef,
)
from messages.sampling import SamplingParams
from messages.step import (
    CachedRequestData,
    GrammarOutput,
    IntermediateTensors,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)

NUM_BLOCKS = 4096  # the KV cache of request_initialize_from_config: every block id is below it
VOCAB_SIZE = 49_152  # SmolLM2's
HIDDEN_SIZE = 576  # SmolLM2-135M's
DEADLINE = 1_767_225_600.25  # a fixed instant: fixtures must not depend on the clock
PP_LAST_RANK = 1  # the examples run tp=1, pp=2: rank 1 samples and replies


def _blocks(rng: Stream, num_tokens: int) -> np.ndarray:
    """A block table covering num_tokens tokens, of distinct random block ids."""
    n = math.ceil(num_tokens / BLOCK_SIZE)
    return rng.distinct(n, NUM_BLOCKS)


def _new_request(
    rng: Stream,
    handle: int,
    prompt_len: int,
    num_scheduled: int | None = None,
    num_computed: int = 0,
    params: SamplingParams | None = None,
    num_output_tokens: int = 0,
) -> NewRequestData:
    scheduled = prompt_len - num_computed if num_scheduled is None else num_scheduled
    return NewRequestData(
        req_id=req_id(handle),
        req_handle=handle,
        prompt_token_ids=rng.ints(prompt_len, 0, VOCAB_SIZE),
        sampling_params=params or SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256),
        block_ids=_blocks(rng, num_computed + scheduled),
        num_scheduled_tokens=scheduled,
        num_computed_tokens=num_computed,
        num_output_tokens=num_output_tokens,
        eos_token_ids=[2],
    )


def prefill_step(num_reqs: int = 8, prompt_len: int = 2048, seed: int = 0) -> SchedulerOutput:
    """num_reqs new requests, each computing its whole prompt of prompt_len tokens."""
    rng = Stream(seed)
    new = [_new_request(rng, h, prompt_len) for h in range(num_reqs)]
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.empty(),
        total_num_scheduled_tokens=num_reqs * prompt_len,
    )


def decode_step(num_reqs: int = 256, new_block_every: int = 16, seed: int = 0) -> SchedulerOutput:
    """num_reqs running requests computing one token each; every new_block_every-th one
    crosses a block boundary (its token starts a block) and gets a new block."""
    rng = Stream(seed)
    handles = rng.distinct(num_reqs, 4 * num_reqs)
    computed = rng.ints(num_reqs, 20, 4000)
    crossing = np.arange(num_reqs) % new_block_every == 0
    computed[crossing] -= computed[crossing] % BLOCK_SIZE
    computed[~crossing] += computed[~crossing] % BLOCK_SIZE == 0
    new_blocks = [
        [int(b)] if i % new_block_every == 0 else []
        for i, b in enumerate(rng.ints(num_reqs, 0, NUM_BLOCKS))
    ]
    cached = CachedRequestData.build(handles, computed, [1] * num_reqs, new_blocks)
    return SchedulerOutput([], cached, total_num_scheduled_tokens=num_reqs)


def async_decode_step(num_reqs: int = 8, seed: int = 3) -> SchedulerOutput:
    """A decode step sent while the step before it is in flight (async scheduling): each
    request's one scheduled token is a placeholder for the token that step samples."""
    rng = Stream(seed)
    handles = rng.distinct(num_reqs, 4 * num_reqs)
    computed = rng.ints(num_reqs, 20, 4000)
    cached = CachedRequestData.build(
        handles, computed, [1] * num_reqs, num_placeholders=[1] * num_reqs
    )
    return SchedulerOutput([], cached, total_num_scheduled_tokens=num_reqs)


def chunked_prefill_step(seed: int = 1) -> SchedulerOutput:
    """A token budget of 2048 shared by: 6 decoding requests, one long prompt in the
    middle of its chunked prefill (chunk 2 of 3), and a new long prompt's first chunk,
    which reuses 64 prefix-cached tokens."""
    rng = Stream(seed)
    new = _new_request(
        rng,
        20,
        prompt_len=3000,
        num_scheduled=1018,
        num_computed=64,
        params=SamplingParams(temperature=0.0, max_tokens=64),
    )
    cached = CachedRequestData.build(
        req_handles=[3, 5, 8, 9, 11, 12, 17],
        num_computed_tokens=[130, 211, 57, 1999, 470, 66, 1024],
        num_scheduled_tokens=[1, 1, 1, 1, 1, 1, 1024],
        new_block_ids=[[], [], [], [], [], [], [int(b) for b in _blocks(rng, 1024)]],
    )
    return SchedulerOutput([new], cached, total_num_scheduled_tokens=6 + 1024 + 1018)


def finished_and_resumed_step(seed: int = 2) -> SchedulerOutput:
    """After memory pressure: two requests finished, one is preempted, one comes back
    resumed with its KV kept (its block table replaced), one restarts from scratch (its
    prompt followed by the 5 tokens it had generated, which its penalties count as
    outputs). As a non-last pipeline stage receives it: new_token_ids carries the tokens
    the last stage sampled."""
    rng = Stream(seed)
    params = SamplingParams(
        seed=1234,
        stop=["\n\n"],
        max_tokens=32,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={100: -5.0, 2001: 2.5},
        min_tokens=8,
        bad_words_token_ids=[[11, 12], [99]],
        allowed_token_ids=[12, 13, 99, 100, 1012, 2001],
    )
    restarted = _new_request(rng, 7, prompt_len=45 + 5, params=params, num_output_tokens=5)
    cached = CachedRequestData.build(
        req_handles=[2, 4, 6],
        num_computed_tokens=[300, 88, 129],
        num_scheduled_tokens=[1, 1, 1],
        new_block_ids=[[], [], [int(b) for b in _blocks(rng, 130)]],
        new_token_ids=[[1012], [13], [28]],
        resumed_req_handles=[6],
    )
    return SchedulerOutput(
        scheduled_new_reqs=[restarted],
        scheduled_cached_reqs=cached,
        total_num_scheduled_tokens=50 + 3,
        finished_req_handles=[1, 3],
        preempted_req_handles=[5],
    )


def grammar_output(seed: int = 3) -> GrammarOutput:
    """Three structured-output requests; a full SmolLM2 vocabulary bitmask each (18 KiB in
    all: the bitmask travels as a frame of its own)."""
    rng = Stream(seed)
    words = math.ceil(VOCAB_SIZE / 32)
    bitmask = rng.ints((3, words), -(2**31), 2**31)
    return GrammarOutput(np.array([4, 9, 12], np.int32), bitmask)


def model_runner_output(num_reqs: int = 256, seed: int = 4) -> ModelRunnerOutput:
    """The answer to decode_step(num_reqs): one sampled token for each of its requests,
    in its order."""
    rng = Stream(seed)
    return ModelRunnerOutput(
        req_handles=decode_step(num_reqs).scheduled_cached_reqs.req_handles.copy(),
        sampled_token_ids=rng.ints(num_reqs, 0, VOCAB_SIZE),
    )


# The logprobs example: the sampled token's rank in each request's distribution; 0 for
# the request mid chunked prefill, which samples nothing.
LOGPROB_RANKS = (1, 3, 0, 9)


def model_runner_output_with_logprobs(seed: int = 5) -> ModelRunnerOutput:
    """Four requests, top-5 logprobs each: the first sampled the most likely token, the
    second the third most likely, the third is mid chunked prefill (it sampled nothing:
    -1 ids, -inf logprobs, rank -1), the fourth sampled the ninth most likely token,
    which is not among the top 5. Each row is a possible distribution: probabilities
    that sum to at most 1, as many tokens more likely than the sampled one as its rank
    says."""
    rng = Stream(seed)
    n, k = len(LOGPROB_RANKS), 5
    ids = np.full((n, k + 1), -1, np.int32)
    logprobs = np.full((n, k + 1), -np.inf, np.float32)
    ranks = np.full(n, -1, np.int32)
    sampled = np.full(n, -1, np.int32)
    for i, rank in enumerate(LOGPROB_RANKS):
        if rank == 0:  # the whole row stays -1 / -inf
            continue
        top_ids = rng.distinct(k + 1, VOCAB_SIZE)  # k for the top, one spare
        # stick breaking: each token takes a share of the mass left, largest first
        shares = rng.floats((k + 1,), 0.2, 0.6)
        left = np.cumprod(np.concatenate([[1.0], 1.0 - shares[:-1]]))
        probs = np.sort(left * shares)[::-1]
        top = np.log(probs[:k]).astype(np.float32)
        ids[i, 1:], logprobs[i, 1:] = top_ids[:k], top
        if rank <= k:  # one of the top k: its own column
            token, logprob = top_ids[rank - 1], top[rank - 1]
        else:  # below the top k, with rank - 1 - k unseen tokens between, each likelier
            token, logprob = top_ids[k], np.float32(np.log(probs[k] / rank))
        sampled[i], ranks[i] = token, rank
        ids[i, 0], logprobs[i, 0] = token, logprob
    return ModelRunnerOutput(
        req_handles=np.array([0, 1, 2, 3], np.int32),
        sampled_token_ids=sampled,
        logprobs=LogprobsLists(ids, logprobs, ranks),
    )


def model_runner_output_with_prompt_logprobs(seed: int = 14) -> ModelRunnerOutput:
    """Two requests asking for top-2 prompt logprobs: handle 4 computes prompt positions
    0..7 of a longer prompt (rows for positions 1..8, no sample), handle 6 the last chunk
    of a 20-token prompt, positions 16..19 (rows for 17..19) and samples."""
    rng = Stream(seed)
    num_rows, k = 11, 2
    ids = np.zeros((num_rows, k + 1), np.int32)
    values = np.zeros((num_rows, k + 1), np.float32)
    ranks = rng.ints(num_rows, 1, 40).astype(np.int32)
    for r, rank in enumerate(ranks.tolist()):
        top_ids = rng.distinct(k + 1, VOCAB_SIZE)  # k for the top, one spare
        top = -np.sort(rng.floats((k,), 0.1, 6.0))  # non-increasing
        ids[r, 1:], values[r, 1:] = top_ids[:k], top
        if rank <= k:  # the prompt token is one of the top k: its own column
            ids[r, 0], values[r, 0] = top_ids[rank - 1], top[rank - 1]
        else:
            ids[r, 0], values[r, 0] = top_ids[k], top[-1] - 1.0
    return ModelRunnerOutput(
        req_handles=np.array([4, 6], np.int32),
        sampled_token_ids=np.array([-1, int(rng.ints(1, 0, VOCAB_SIZE)[0])], np.int32),
        prompt_logprobs=PromptLogprobs(
            req_handles=np.array([4, 6], np.int32),
            first_positions=np.array([1, 17], np.int32),
            num_rows=np.array([8, 3], np.int32),
            rows=LogprobsLists(ids, values, ranks),
        ),
    )


def intermediate_tensors(num_tokens: int = 16, seed: int = 6) -> IntermediateTensors:
    """Hidden states and residual of num_tokens tokens in bfloat16: 18 KiB each at 16
    tokens, above the inline limit, so each travels as a frame of its own."""
    rng = Stream(seed)

    def bf16() -> torch.Tensor:
        values = rng.floats((num_tokens, HIDDEN_SIZE), -4.0, 4.0)
        return torch.from_numpy(values).to(torch.bfloat16)

    return IntermediateTensors({"hidden_states": bf16(), "residual": bf16()})


def shared_slot(num_tokens: int = 16) -> SharedSlot:
    """Where a sender on the same host left intermediate_tensors(num_tokens): slot 1 of a
    4-slot segment of 1 MiB slots behind a one-page header, at 64-byte aligned offsets."""
    slot_bytes, header_bytes, slot = 1 << 20, 4096, 1
    start = header_bytes + slot * slot_bytes
    tensor_bytes = num_tokens * HIDDEN_SIZE * 2
    refs = [
        SharedTensorRef(name, "bfloat16", [num_tokens, HIDDEN_SIZE], start + i * tensor_bytes)
        for i, name in enumerate(("hidden_states", "residual"))
    ]
    return SharedSlot(
        pid=48212,
        fd=23,
        generation=731_245_509_117,
        nbytes=header_bytes + 4 * slot_bytes,
        slot=slot,
        seq=5,
        tensors=refs,
    )


def _request(call_id: int, method: str, *args: Any, **kwargs: Any) -> RpcRequest:
    return RpcRequest(call_id, method, list(args), kwargs)


def _step(call_id: int, method: str, **arguments: Any) -> RpcRequest:
    """A per-step call as the engine sends it: bounded, answered by the last stage only."""
    return RpcRequest(call_id, method, kwargs=arguments, deadline=DEADLINE, reply_rank=PP_LAST_RANK)


def execute_model_request(step: SchedulerOutput, call_id: int = 100) -> RpcRequest:
    """step as it travels: the single positional argument of execute_model."""
    return RpcRequest(call_id, "execute_model", [step], deadline=DEADLINE, reply_rank=PP_LAST_RANK)


def execute_model_reply(output: ModelRunnerOutput, call_id: int = 100) -> RpcReply:
    """output as it travels: the result of execute_model from the last pipeline stage."""
    return RpcReply(call_id, PP_LAST_RANK, result=output)


def error_reply() -> RpcReply:
    trace = (
        "Traceback (most recent call last):\n"
        '  File "zmqworker/worker/torch_worker.py", line 141, in execute_model\n'
        "    return self.model_runner.execute_model(scheduler_output)\n"
        "RuntimeError: request handle 77 is not in the persistent batch\n"
    )
    error = RemoteError(
        rank=1,
        exc_type="RuntimeError",
        message="request handle 77 is not in the persistent batch",
        traceback=trace,
    )
    return RpcReply(call_id=101, rank=1, error=error)


# name -> builder. The fixtures are messages/fixtures/<name>.msgpack, in start-up order
# first, then the steps.
EXAMPLES: dict[str, Callable[[], Message]] = {
    "hello": hello,
    "welcome": welcome,
    "request_init_device": lambda: _request(1, "init_device"),
    "reply_none": lambda: RpcReply(call_id=1, rank=1),
    "request_load_model": lambda: _request(2, "load_model"),
    "request_determine_available_memory": lambda: _request(3, "determine_available_memory"),
    "reply_available_memory": lambda: RpcReply(call_id=3, rank=1, result=6_442_450_944),
    "request_get_kv_cache_spec": lambda: _request(4, "get_kv_cache_spec"),
    "reply_kv_cache_spec": lambda: RpcReply(call_id=4, rank=1, result=kv_cache_spec()),
    "request_initialize_from_config": lambda: _request(
        5, "initialize_from_config", make_kv_cache_config([kv_cache_spec()], NUM_BLOCKS)
    ),
    "request_compile_or_warm_up_model": lambda: _request(6, "compile_or_warm_up_model"),
    "request_collective_rpc_plain_values": lambda: _request(
        7, "echo", 3, 0.5, "text", True, None, [1, "two", 3.0], limit=10, tags=["a", "b"]
    ),
    "request_prefill": lambda: execute_model_request(prefill_step(num_reqs=3, prompt_len=640)),
    "request_chunked_prefill": lambda: execute_model_request(chunked_prefill_step()),
    "request_decode_256": lambda: execute_model_request(decode_step()),
    "request_decode_async": lambda: execute_model_request(async_decode_step(), call_id=103),
    "request_finished_resumed": lambda: execute_model_request(finished_and_resumed_step()),
    "request_sample_tokens_grammar": lambda: _step(
        102, "sample_tokens", grammar_output=grammar_output()
    ),
    "reply_decode_256": lambda: execute_model_reply(model_runner_output()),
    "reply_logprobs": lambda: execute_model_reply(model_runner_output_with_logprobs()),
    "reply_prompt_logprobs": lambda: execute_model_reply(
        model_runner_output_with_prompt_logprobs()
    ),
    "reply_error": error_reply,
    "ping": Ping,
    "pipeline_tensors_bf16": lambda: PipelineTensors(
        call_id=100, src_rank=0, tensors=intermediate_tensors(), run_id=RUN_ID
    ),
    "pipeline_shared_tensors": lambda: PipelineSharedTensors(
        call_id=100, src_rank=0, shared=shared_slot(), run_id=RUN_ID
    ),
    "pipeline_step_refused": lambda: PipelineStepRefused(
        call_id=100, src_rank=0, reason="ValueError: request 'r7' (handle 7): ...", run_id=RUN_ID
    ),
    **WEIGHT_EXAMPLES,
    **KV_TRANSFER_EXAMPLES,
    **ENGINE_CORE_EXAMPLES,  # then a client and an engine core's
}
