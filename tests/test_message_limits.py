"""The size bounds of a run's sockets (zmqworker/executor/message_limits.py, and
docs/protocol.md, "Size limits"): each is a bound on one frame, in bytes: the largest
array the socket's messages carry for the run's configuration (max_logprobs = -1, the
whole vocabulary, included), plus room for a body."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from messages import (
    CachedRequestData,
    Encoder,
    GrammarOutput,
    IntermediateTensors,
    LogprobsLists,
    ModelConfig,
    ModelRunnerOutput,
    NewRequestData,
    PipelineTensors,
    RpcReply,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
)
from messages.codec import INLINE_MAX_BYTES
from messages.sampling import INT32_MAX, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from zmqworker.executor.message_limits import BODY_ROOM, MessageLimits, message_limits
from zmqworker.transport.spawn_env import message_bounds

# large enough that every array below travels in a data frame of its own (over 16 KiB),
# and that a reply with every logprob outgrows the body's room
VOCAB, HIDDEN, MAX_LEN, BLOCK = 50_000, 64, 4096, 16
SEQS, TOKENS = 32, 2048


def run_config(tmp_path: Path, max_logprobs: int) -> WorkerConfig:
    shape = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    return WorkerConfig(
        model=ModelConfig(path=str(tmp_path), max_model_len=MAX_LEN, max_logprobs=max_logprobs),
        scheduler=SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=TOKENS),
    )


@pytest.mark.parametrize(
    ("max_logprobs", "per_request"), [(20, 20), (0, 0), (100_000, VOCAB), (-1, VOCAB)]
)
def test_the_reply_bound_counts_the_logprobs_a_request_may_ask_for(
    tmp_path: Path, max_logprobs: int, per_request: int
) -> None:
    limits = message_limits(run_config(tmp_path, max_logprobs))
    # A row per request that samples, or per prompt token of the step (prompt logprobs).
    assert limits.reply_bytes == max(SEQS, TOKENS) * (per_request + 1) * 4 + BODY_ROOM
    # One request's prompt logprobs, a row per position, on their way to its client.
    assert limits.prompt_logprobs_bytes == MAX_LEN * (per_request + 1) * 4 + BODY_ROOM


def fits(msg, bound: int) -> bool:
    """Every data frame of msg within the bound's arrays, its body within the room."""
    sizes = [len(f) if isinstance(f, bytes) else f.nbytes for f in Encoder().encode(msg)]
    return sizes[0] <= BODY_ROOM and all(size <= bound - BODY_ROOM for size in sizes[1:])


def test_the_largest_reply_fits_with_every_logprob(tmp_path: Path) -> None:
    limits = message_limits(run_config(tmp_path, -1))
    k = VOCAB  # -1: a request may ask for the whole vocabulary
    logprobs = LogprobsLists(
        np.zeros((SEQS, k + 1), np.int32),
        np.zeros((SEQS, k + 1), np.float32),
        np.zeros(SEQS, np.int32),
    )
    output = ModelRunnerOutput(np.arange(SEQS, dtype=np.int32), np.zeros(SEQS, np.int32), logprobs)
    assert logprobs.logprobs.nbytes > BODY_ROOM  # the bound's room alone would not hold it
    assert fits(RpcReply(1, 0, result=output), limits.reply_bytes)


def step_request(step: SchedulerOutput) -> RpcRequest:
    return RpcRequest(1, "execute_model", [step])


def test_the_largest_requests_fit(tmp_path: Path) -> None:
    limits = message_limits(run_config(tmp_path, 20))
    blocks = math.ceil(MAX_LEN / BLOCK)
    prompt = NewRequestData(
        "a", 0, np.zeros(MAX_LEN, np.int32), SamplingParams(), np.zeros(blocks, np.int32), 1
    )
    # every request resumed (each sends its whole block table), a step's worth of tokens
    resumed = CachedRequestData.build(
        list(range(SEQS)),
        [0] * SEQS,
        [1] * SEQS,
        [[0] * blocks] * SEQS,
        [[0] * (TOKENS // SEQS)] * SEQS,
        list(range(SEQS)),
    )
    bitmask = np.zeros((SEQS, math.ceil(VOCAB / 32)), np.int32)
    for request in (
        step_request(SchedulerOutput([prompt], CachedRequestData.empty(), 1)),
        step_request(SchedulerOutput([], resumed, SEQS)),
        RpcRequest(2, "sample_tokens", [GrammarOutput(np.arange(SEQS, dtype=np.int32), bitmask)]),
    ):
        assert fits(request, limits.request_bytes), request.method


def largest_params(vocab: int) -> SamplingParams:
    """The largest per-request lists the engine accepts: a logit_bias on every token of
    the vocabulary, every bad word it allows at its longest."""
    return SamplingParams(
        logit_bias={token: -100.0 for token in range(vocab)},
        bad_words_token_ids=[[INT32_MAX] * MAX_BAD_WORD_TOKENS] * MAX_BAD_WORDS,
        stop_token_ids=list(range(1000)),
        stop=["a stop string"] * 100,
    )


def test_a_step_of_new_requests_at_their_largest_fits(tmp_path: Path) -> None:
    """Each fits alone; max_num_seqs of them in one step's body must fit as well."""
    limits = message_limits(run_config(tmp_path, 20))
    params = largest_params(VOCAB)
    inline = INLINE_MAX_BYTES // 4  # the most of an array a body holds
    requests = [
        NewRequestData(
            f"r{i}", i, np.zeros(inline, np.int32), params, np.zeros(inline, np.int32), 1
        )
        for i in range(SEQS)
    ]
    frames = Encoder().encode(
        step_request(SchedulerOutput(requests, CachedRequestData.empty(), SEQS))
    )
    assert len(frames) == 1 and len(frames[0]) > BODY_ROOM  # all in the body
    assert len(frames[0]) <= limits.request_bytes


def test_a_step_of_requests_with_large_logit_biases_runs(tmp_path: Path) -> None:
    """End to end: requests whose logit_bias covers a large vocabulary, each accepted,
    run together in one step (the bound once left them out: the step was refused)."""
    from tests.engine_helpers import byte_level_tokenizer
    from tests.tiny import cached_tiny_checkpoint
    from zmqworker.frontend.llm import LLM

    vocab = 1 << 17
    path = cached_tiny_checkpoint(family="llama", num_layers=1, vocab_size=vocab)
    if not (Path(path) / "tokenizer.json").exists():
        byte_level_tokenizer().save_pretrained(path)
    bias = {token: 0.5 for token in range(vocab)}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias=bias)
    with LLM(
        model=path, max_model_len=64, block_size=4, kv_cache_bytes=1 << 22, max_num_seqs=8
    ) as llm:
        outputs = llm.generate([[5, 6, 7 + i] for i in range(4)], params)
    assert [len(output.token_ids) for output in outputs] == [2] * 4


def test_the_largest_pipeline_tensors_fit(tmp_path: Path) -> None:
    limits = message_limits(run_config(tmp_path, 20))
    tensors = {name: torch.zeros(TOKENS, HIDDEN) for name in ("hidden_states", "residual")}
    message = PipelineTensors(1, 0, IntermediateTensors(tensors))
    assert fits(message, limits.pipeline_bytes)


def test_zmq_maxmsgsize_bounds_each_frame_not_the_message(tmp_path: Path) -> None:
    """What the bounds rely on: a message of two frames each under the bound, together
    over it, is taken in."""
    bound = 1000
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.setsockopt(zmq.MAXMSGSIZE, bound)
        pull.bind(f"ipc://{tmp_path}/bound.sock")
        push.connect(f"ipc://{tmp_path}/bound.sock")
        push.send_multipart([b"a" * 800, b"b" * 800])
        assert pull.poll(10_000), "the two-frame message did not arrive"
        assert [len(f) for f in pull.recv_multipart()] == [800, 800]
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


def test_the_worker_s_bounds_travel_as_three_byte_counts() -> None:
    limits = MessageLimits(reply_bytes=3, request_bytes=5, pipeline_bytes=7)
    assert limits.to_env() == "5,7,3"


@pytest.mark.parametrize(
    ("value", "bounds"), [("", (-1, -1, -1)), ("5,7", (5, 7, -1)), ("5,7,3", (5, 7, 3))]
)
def test_a_worker_reads_two_or_three_byte_counts(value: str, bounds: tuple) -> None:
    assert message_bounds(value) == bounds


@pytest.mark.parametrize("value", ["5", "5,7,3,1", "5,0", "5,-7", "a,b"])
def test_a_worker_refuses_other_bounds(value: str) -> None:
    with pytest.raises(ValueError, match="two or three byte counts, REQUEST,PIPELINE"):
        message_bounds(value)
