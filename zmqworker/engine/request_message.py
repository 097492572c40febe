"""An EngineCoreRequest as the engine core takes it in: checked as the workers would check
it (a bad prompt would fail the whole step, and every request in it), and made a Request."""

from __future__ import annotations

import numpy as np

from messages import EngineCoreConfig, EngineCoreRequest, SamplingParams
from zmqworker.engine.request import RemotePrefill, Request
from zmqworker.executor.message_limits import LARGE_VOCAB

# What a new request adds to a step's body beyond its arrays and the bounded lists
# (logit_bias, bad words, allowed_token_ids) must fit the room the workers' bound leaves it
# (executor/message_limits.py REQUEST_ROOM): these bound the rest.
MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_ID_CHARS = 1024


def request_of(msg: EngineCoreRequest, config: EngineCoreConfig) -> Request:
    """The Request of msg; a ValueError naming what is wrong with it."""
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(
            f"request id of {len(msg.request_id)} characters: at most {MAX_REQUEST_ID_CHARS}"
        )
    check_lists(msg.sampling_params)
    transfer = msg.kv_transfer_params
    remote = None
    if transfer is not None and transfer.remote is not None:
        assert transfer.first_token is not None  # KVTransferParams checks it
        remote = RemotePrefill(transfer.remote, transfer.first_token)
    return Request(
        msg.request_id,
        _prompt(msg, config),
        msg.sampling_params,
        eos_token_ids=msg.eos_token_ids,
        arrival_time=msg.arrival_time,
        shares_prompt_with=msg.shares_prompt_with,
        remote_decode=transfer is not None and transfer.do_remote_decode,
        remote=remote,
        max_uncached_tokens=None if transfer is None else transfer.max_uncached_tokens,
    )


def _prompt(msg: EngineCoreRequest, config: EngineCoreConfig) -> list[int]:
    """The prompt's ids, within the vocabulary, as are the remote prefill's first token
    and the sampling parameters' token ids, and the logprobs asked for within the model's
    bound; no longer than truncate_prompt_tokens (-1: max_model_len, checked as ever)."""
    ids = msg.prompt_token_ids
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_token_ids must be one row of integers, got {ids.dtype}")
    vocab = config.vocab_size
    if len(ids) and (ids.min() < 0 or (vocab is not None and ids.max() >= vocab)):
        raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab})")
    transfer = msg.kv_transfer_params
    first = None if transfer is None else transfer.first_token
    if first is not None and vocab is not None and first >= vocab:
        raise ValueError(f"kv_transfer_params.first_token {first} is outside [0, {vocab})")
    params = msg.sampling_params
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > 0 and len(ids) > keep:
        # The client cuts the prompt (frontend/new_requests.py); one that sends more than
        # it asked to keep skipped that, and computing the whole prompt would be wrong.
        raise ValueError(
            f"the prompt has {len(ids)} tokens, more than truncate_prompt_tokens={keep}: "
            "the client keeps the prompt's last tokens before it sends the request"
        )
    max_logprobs = config.worker.model.max_logprobs
    over = params.logprobs_over(max_logprobs)
    if over is not None:
        raise ValueError(f"{over[0]}={over[1]} is more than max_logprobs={max_logprobs}")
    if vocab is not None:
        check_token_ids(params, vocab)
    return ids.tolist()


def check_lists(params: SamplingParams) -> None:
    """ValueError where a list the schema leaves unbounded is longer than a step takes
    (logit_bias and allowed_token_ids: the vocabulary, where it is known, checks them
    closer; where not, the workers' bound takes LARGE_VOCAB ids of each)."""
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids holds {len(params.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}"
        )
    for field, ids in (("logit_bias", params.logit_bias),
                       ("allowed_token_ids", params.allowed_token_ids or ())):  # fmt: skip
        if len(ids) > LARGE_VOCAB:
            raise ValueError(f"{field} holds {len(ids)} ids, more than {LARGE_VOCAB}")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the first token id of params outside the vocabulary, or the top-n
    logprobs asked for beyond it (with max_logprobs -1 nothing else bounds them), or an
    allowed_token_ids longer than the vocabulary (the bound a step's room counts on)."""
    outside = params.token_id_outside(vocab_size)
    if outside is not None:
        field, token = outside
        raise ValueError(f"{field}: token id {token} is outside the vocabulary [0, {vocab_size})")
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) > vocab_size:
        raise ValueError(
            f"allowed_token_ids holds {len(allowed)} ids, more than the vocabulary's "
            f"{vocab_size} tokens (give each id once)"
        )
    over = params.logprobs_over(vocab_size)
    if over is not None:
        raise ValueError(f"{over[0]}={over[1]} is more than the vocabulary's {vocab_size} tokens")
