"""The largest message each socket of a run can legitimately receive, from the run's
configuration: every receiving socket is given its bound (ZMQ_MAXMSGSIZE, per frame), and
a peer that sends more is disconnected before the frame is taken in.

The bounds are generous (each the largest frame the protocol can make for this run, plus
room for the message body) but finite: junk of hundreds of megabytes no longer fills the
engine's memory. The model's shape comes from its config.json when the engine can read it;
otherwise from bounds large enough for any Llama-family model.

A step's body holds its new requests inline, each with its SamplingParams, whose lists
can be large (a logit_bias or allowed_token_ids on the whole vocabulary): the workers'
bound counts max_num_seqs of them at the largest the engine accepts, so that a step made
of accepted requests is not refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from messages import WorkerConfig
from messages.codec import INLINE_MAX_BYTES
from messages.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from zmqworker.cdiv import cdiv
from zmqworker.transport.frames import MAX_FRAMES

BODY_ROOM = 4 << 20  # a message body, and any frame that is not an array of the step
LARGE_VOCAB = 1 << 18  # when config.json cannot be read
LARGE_HIDDEN = 1 << 14
# The most MessagePack takes for a token id (a uint32), a float (a float64), a list's
# header.
ID_BYTES, FLOAT_BYTES, LIST_BYTES = 5, 9, 5
# A new request's share of a body besides its arrays, logit_bias, bad words and allowed
# token ids: its id, counts and scalar parameters, its stop ids and end-of-sequence ids
# (the engine bounds the id and the stop ids: engine/request_message.py; stop strings
# stay with it).
REQUEST_ROOM = 64 << 10


@dataclass(frozen=True)
class MessageLimits:
    reply_bytes: int  # what the engine's ROUTER takes in: replies, Hellos
    request_bytes: int  # what a worker's DEALER takes in: requests, the Welcome
    pipeline_bytes: int  # what a pipeline stage's PULL takes in: one stage's tensors
    prompt_logprobs_bytes: int = 0  # one request's prompt logprobs, one array of them

    def to_env(self) -> str:
        return f"{self.request_bytes},{self.pipeline_bytes},{self.reply_bytes}"


def check_request_frames(method: str, frames: Sequence[bytes | memoryview], limit: int) -> None:
    """Refuse a request a worker would drop: with the connection, for a frame past limit;
    alone, for more frames than its socket takes (MAX_FRAMES)."""
    if len(frames) > MAX_FRAMES:
        raise ValueError(
            f"{method}: the request has {len(frames)} frames, more than the {MAX_FRAMES} a "
            "worker takes in one message"
        )
    largest = max(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)
    if largest > limit:
        raise ValueError(
            f"{method}: the request has a frame of {largest} bytes, more than the {limit} "
            "bytes a worker of this run takes in (the bound follows from the run's config: "
            "max_num_seqs, max_model_len, the vocabulary)"
        )


def message_limits(config: WorkerConfig) -> MessageLimits:
    """The run's bounds; a ValueError for a config they cannot follow from."""
    _check_sizes(config)
    vocab, hidden, max_positions = _model_shape(config.model.path)
    scheduler = config.scheduler
    seqs, tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    max_len = config.model.max_model_len or max_positions
    blocks = cdiv(max_len, config.cache.block_size)
    # Up to max_logprobs top-n logprobs and the sampled one (the worker's own bound).
    max_logprobs = config.model.max_logprobs
    per_seq = vocab if max_logprobs < 0 else min(max_logprobs, vocab)
    # A row per request that samples, or per prompt token (prompt logprobs).
    reply = max(seqs, tokens) * (per_seq + 1) * 4
    # A prompt, a request's block table, every request's new blocks, a grammar bitmask;
    # and a step of new requests, in its body.
    request = max(max_len + 1, seqs * blocks, tokens, seqs * cdiv(vocab, 32)) * 4
    request += seqs * _new_request_bytes(vocab, max_len, blocks)
    pipeline = tokens * hidden * 4  # hidden states or residual, float32 at most
    prompt = max_len * (per_seq + 1) * 4
    return MessageLimits(
        reply + BODY_ROOM, request + BODY_ROOM, pipeline + BODY_ROOM, prompt + BODY_ROOM
    )


def _new_request_bytes(vocab: int, max_len: int, blocks: int) -> int:
    """The most one NewRequestData adds to a step's body: its prompt and block table
    (inline up to the codec's limit), and its SamplingParams at the bounds the engine
    keeps: a logit_bias on every token of the vocabulary (it refuses an id outside it),
    MAX_BAD_WORDS bad words of MAX_BAD_WORD_TOKENS ids, allowed_token_ids of up to
    vocabulary-many ids."""
    arrays = min((max_len + 1) * 4, INLINE_MAX_BYTES) + min(blocks * 4, INLINE_MAX_BYTES)
    logit_bias = vocab * (ID_BYTES + FLOAT_BYTES)
    bad_words = MAX_BAD_WORDS * (LIST_BYTES + MAX_BAD_WORD_TOKENS * ID_BYTES)
    allowed = LIST_BYTES + vocab * ID_BYTES
    return arrays + logit_bias + bad_words + allowed + REQUEST_ROOM


def _check_sizes(config: WorkerConfig) -> None:
    """A ValueError naming a size the bounds divide or multiply by that is below 1."""
    sizes = {
        "cache.block_size": config.cache.block_size,
        "scheduler.max_num_seqs": config.scheduler.max_num_seqs,
        "scheduler.max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"WorkerConfig {name} must be at least 1, got {value}")


def _model_shape(path: str) -> tuple[int, int, int]:
    """(vocab_size, hidden_size, max_position_embeddings) from config.json, or bounds
    for any model when it cannot be read."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        shape = (cfg["vocab_size"], cfg["hidden_size"], cfg.get("max_position_embeddings", 1))
        if all(isinstance(v, int) and v > 0 for v in shape):
            return shape
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return LARGE_VOCAB, LARGE_HIDDEN, 1 << 17
