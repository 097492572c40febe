"""The golden fixtures mean what docs/protocol.md says their fields mean: a decoder in
another language that checks the documented meanings accepts every one of them.

test_fixtures.py checks the bytes; this checks the values, as one run: the Welcome's
configuration (tp=1, pp=2, SmolLM2-135M), the KV cache of request_initialize_from_config,
and the vocabulary of SmolLM2 (no message carries it)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from messages import (
    PROTOCOL_VERSION,
    Decoder,
    LogprobsLists,
    ModelRunnerOutput,
    RpcReply,
    RpcRequest,
    SchedulerOutput,
)
from messages import examples as ex
from messages.codec import DTYPE_NAMES
from messages.kv_cache import DTYPE_BYTES
from messages.make_fixtures import FIXTURES_DIR, unpack_frames

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

FIXTURES = {
    name: Decoder().decode(unpack_frames((FIXTURES_DIR / f"{name}.msgpack").read_bytes()))
    for name in ex.EXAMPLES
}
CONFIG = FIXTURES["welcome"].config
TP, PP = CONFIG.parallel.tensor_parallel_size, CONFIG.parallel.pipeline_parallel_size
LAST_STAGE_RANK = (PP - 1) * TP  # the rank that answers the steps
NUM_BLOCKS = FIXTURES["request_initialize_from_config"].args[0].num_blocks
MAX_MODEL_LEN = CONFIG.model.max_model_len
MAX_BLOCKS = math.ceil(MAX_MODEL_LEN / CONFIG.cache.block_size)
VOCAB = ex.VOCAB_SIZE
STEPS = sorted(
    name
    for name, msg in FIXTURES.items()
    if isinstance(msg, RpcRequest) and msg.method == "execute_model"
)


def test_the_run_id_is_32_hex_digits_and_the_pipeline_messages_carry_it() -> None:
    run_id = FIXTURES["welcome"].run_id
    assert re.fullmatch(r"[0-9a-f]{32}", run_id), run_id
    for name in ("pipeline_tensors_bf16", "pipeline_shared_tensors"):
        assert FIXTURES[name].run_id == run_id, name


def test_the_hello_is_one_rank_of_the_welcome_s_run() -> None:
    hello, welcome = FIXTURES["hello"], FIXTURES["welcome"]
    assert hello.protocol_version == PROTOCOL_VERSION
    assert len(welcome.data_addresses) == TP * PP
    assert 0 <= hello.rank < TP * PP
    assert welcome.data_addresses[hello.rank] == hello.data_address


def test_the_pipeline_messages_come_from_the_previous_stage_in_the_model_s_dtype() -> None:
    dtype = CONFIG.model.dtype
    plain = FIXTURES["pipeline_tensors_bf16"]
    assert plain.src_rank == LAST_STAGE_RANK - TP
    tensors = plain.tensors.tensors
    assert set(tensors) == {"hidden_states", "residual"}
    for tensor in tensors.values():
        assert str(tensor.dtype) == f"torch.{dtype}"
        assert tensor.shape == tensors["hidden_states"].shape
        assert tensor.shape[1] == ex.HIDDEN_SIZE
    shared = FIXTURES["pipeline_shared_tensors"]
    assert shared.src_rank == LAST_STAGE_RANK - TP
    slot = shared.shared
    assert [t.name for t in slot.tensors] == list(tensors)
    for ref in slot.tensors:
        assert ref.dtype == dtype and ref.dtype in DTYPE_NAMES
        size = math.prod(ref.shape) * DTYPE_BYTES[ref.dtype]
        assert ref.offset % DTYPE_BYTES[ref.dtype] == 0
        assert ref.offset + size <= slot.nbytes


def test_the_kv_cache_messages_fit_the_run() -> None:
    spec = FIXTURES["reply_kv_cache_spec"].result
    assert spec.block_size == CONFIG.cache.block_size
    assert spec.dtype == CONFIG.model.dtype  # cache_dtype "auto": the model's
    config = FIXTURES["request_initialize_from_config"].args[0]
    assert config.num_blocks >= 1
    named = {name for t in config.tensors for name in t.shared_by}
    assert set(spec.layer_names) <= named
    for tensor in config.tensors:
        assert tensor.size_bytes >= config.num_blocks * spec.page_size_bytes
    [group] = config.groups
    assert set(spec.layer_names) <= set(group.layer_names)
    same_shape = ("block_size", "num_kv_heads", "head_size", "dtype")
    assert all(getattr(group.spec, f) == getattr(spec, f) for f in same_shape)


def in_range(values: np.ndarray | None, high: int) -> bool:
    return values is None or bool(((values >= 0) & (values < high)).all())


@pytest.mark.parametrize("name", STEPS)
def test_each_step_keeps_the_documented_rules(name: str) -> None:
    call = FIXTURES[name]
    # With KV transfer over the stages every stage's first rank answers, with its report.
    stage_ranks = list(range(0, PP * TP, TP))
    assert call.reply_rank in (LAST_STAGE_RANK, stage_ranks)
    [step] = call.args
    assert isinstance(step, SchedulerOutput)
    cached = step.scheduled_cached_reqs
    columns = cached.columns
    assert columns.dtype == np.int32 and columns.shape == (6, len(cached))
    handles = [*cached.req_handles.tolist(), *(r.req_handle for r in step.scheduled_new_reqs)]
    assert len(set(handles)) == len(handles), "a request is scheduled once"
    assert all(0 <= h < 2**31 for h in handles)
    assert len(handles) <= CONFIG.scheduler.max_num_seqs
    left = set(step.finished_req_handles) | set(step.preempted_req_handles)
    assert not left & set(cached.req_handles.tolist()), "finished and preempted leave first"
    assert set(cached.resumed_req_handles) <= set(cached.req_handles.tolist())
    scheduled = int(cached.num_scheduled_tokens.sum())
    scheduled += sum(r.num_scheduled_tokens for r in step.scheduled_new_reqs)
    assert step.total_num_scheduled_tokens == scheduled
    assert scheduled <= CONFIG.scheduler.max_num_batched_tokens
    for req in step.scheduled_new_reqs:
        check_new_request(req)
    check_cached_requests(cached)


def check_new_request(req: Any) -> None:
    prompt = req.prompt_token_ids
    assert 1 <= len(prompt) <= MAX_MODEL_LEN and in_range(prompt, VOCAB)
    assert req.num_scheduled_tokens >= 1 and req.num_computed_tokens >= 0
    end = req.num_computed_tokens + req.num_scheduled_tokens
    assert end <= len(prompt)
    assert len(req.block_ids) * CONFIG.cache.block_size >= end, "blocks cover the tokens"
    assert len(req.block_ids) <= MAX_BLOCKS and in_range(req.block_ids, NUM_BLOCKS)
    logprobs = req.sampling_params.logprobs
    assert logprobs is None or logprobs <= CONFIG.model.max_logprobs


def check_cached_requests(cached: Any) -> None:
    computed, scheduled = cached.num_computed_tokens, cached.num_scheduled_tokens
    assert (scheduled >= 1).all() and (computed >= 0).all()
    end = computed.astype(np.int64) + scheduled
    assert (end <= MAX_MODEL_LEN).all()
    for flat, counts in (
        (cached.new_block_ids, cached.num_new_blocks),
        (cached.new_token_ids, cached.num_new_tokens),
    ):
        assert (counts >= 0).all()
        assert (0 if flat is None else len(flat)) == int(counts.sum())
    assert in_range(cached.new_block_ids, NUM_BLOCKS) and in_range(cached.new_token_ids, VOCAB)
    placeholders = cached.num_placeholders
    assert set(placeholders.tolist()) <= {0, 1}
    resumed = np.isin(cached.req_handles, cached.resumed_req_handles)
    has = placeholders == 1
    assert not (has & resumed).any(), "no placeholder on a resumed request"
    reach = computed + cached.num_new_tokens
    assert not (has & (reach > end - 1)).any(), "new_token_ids stop before the placeholder"
    # a resumed request's block table is replaced: its new blocks alone cover its tokens
    blocks = cached.num_new_blocks
    assert (blocks[resumed] * CONFIG.cache.block_size >= end[resumed]).all()
    assert (blocks <= MAX_BLOCKS).all()


def test_the_async_step_is_all_placeholders() -> None:
    cached = FIXTURES["request_decode_async"].args[0].scheduled_cached_reqs
    assert len(cached) and (cached.num_placeholders == 1).all()


def test_the_grammar_output_allows_a_token_in_every_row() -> None:
    grammar = FIXTURES["request_sample_tokens_grammar"].kwargs["grammar_output"]
    handles, bitmask = grammar.req_handles, grammar.grammar_bitmask
    assert len(set(handles.tolist())) == len(handles)
    assert bitmask.shape == (len(handles), math.ceil(VOCAB / 32))
    assert (bitmask != 0).any(axis=1).all()


def test_the_decode_reply_answers_the_decode_step_in_its_order() -> None:
    step = FIXTURES["request_decode_256"].args[0]
    reply = FIXTURES["reply_decode_256"]
    assert reply.call_id == FIXTURES["request_decode_256"].call_id
    assert reply.rank == LAST_STAGE_RANK
    output = reply.result
    assert np.array_equal(output.req_handles, step.scheduled_cached_reqs.req_handles)
    # every request decodes the token after its last one: each samples
    assert in_range(output.sampled_token_ids, VOCAB)


@pytest.mark.parametrize("name", ["reply_decode_256", "reply_logprobs"])
def test_each_step_reply_is_one_row_per_request(name: str) -> None:
    reply = FIXTURES[name]
    assert isinstance(reply, RpcReply) and reply.error is None
    output = reply.result
    assert isinstance(output, ModelRunnerOutput)
    n = len(output.req_handles)
    assert output.sampled_token_ids.shape == (n,)
    sampled = output.sampled_token_ids
    assert ((sampled == -1) | ((sampled >= 0) & (sampled < VOCAB))).all()
    if output.logprobs is not None:
        check_logprobs(output.logprobs, sampled)


def check_logprobs(lists: LogprobsLists, sampled: np.ndarray) -> None:
    """The documented meanings: row i is request i; column 0 the sampled token, columns
    1..k the top k, most likely first; the rank counts the tokens strictly more likely,
    plus one; a request that sampled nothing has ids -1, logprobs -inf and rank -1."""
    ids, logprobs, ranks = lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks
    n = len(sampled)
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32 and ranks.dtype == np.int32
    assert ids.ndim == 2 and ids.shape[0] == n and ids.shape[1] >= 1
    assert logprobs.shape == ids.shape and ranks.shape == (n,)
    k = ids.shape[1] - 1
    for i, token in enumerate(sampled.tolist()):
        row, values, rank = ids[i], logprobs[i], int(ranks[i])
        if token == -1:
            assert (row == -1).all() and (values == -np.inf).all() and rank == -1, i
            continue
        assert row[0] == token, f"row {i}: column 0 is {row[0]}, the sampled token {token}"
        top, top_values = row[1:], values[1:]
        assert in_range(top, VOCAB) and len(set(top.tolist())) == k, i
        assert np.isfinite(values).all() and (values <= 0).all(), i
        assert (np.diff(top_values) <= 0).all(), f"row {i}: the top k, most likely first"
        assert rank >= 1, i
        more_likely = int((top_values > values[0]).sum())
        assert more_likely == min(rank - 1, k), f"row {i}: rank {rank}"
        if rank <= k:  # then the sampled token is one of the top k, in its own column
            assert top[rank - 1] == token and top_values[rank - 1] == values[0], i
        # the tokens it names cannot hold more than all of the probability
        mass = np.exp(top_values.astype(np.float64)).sum()
        if rank > k:
            mass += (rank - k) * math.exp(values[0])
        assert mass <= 1 + 1e-6, f"row {i}: probabilities sum to {mass}"


def test_the_logprobs_check_refuses_what_the_document_does_not_allow() -> None:
    output = FIXTURES["reply_logprobs"].result
    sampled, lists = output.sampled_token_ids, output.logprobs
    check_logprobs(lists, sampled)
    assert -1 in sampled.tolist() and (lists.sampled_token_ranks > ex.LOGPROB_RANKS[0]).any()

    def broken(field: str, i: int, j: int | None, value: Any) -> LogprobsLists:
        array = getattr(lists, field).copy()
        array[i if j is None else (i, j)] = value
        return LogprobsLists(**{**{f: getattr(lists, f) for f in lists.__struct_fields__},
                                field: array})  # fmt: skip

    nothing = int(np.flatnonzero(sampled == -1)[0])
    for bad in (
        broken("logprob_token_ids", 0, 0, (sampled[0] + 1) % VOCAB),  # not the sampled token
        broken("logprob_token_ids", nothing, 1, 7),  # a real id where nothing was sampled
        broken("logprobs", nothing, 0, -1.0),  # a finite logprob there
        broken("sampled_token_ranks", nothing, None, 0),  # a rank there
        broken("sampled_token_ranks", 1, None, 2),  # another rank than the logprobs say
    ):
        with pytest.raises(AssertionError):
            check_logprobs(bad, sampled)


def test_the_error_reply_has_no_result() -> None:
    reply = FIXTURES["reply_error"]
    assert reply.result is None and reply.error is not None
    assert reply.error.rank == reply.rank and reply.error.traceback
