"""A step's sampled tokens applied to the running requests, in bulk where nothing can
finish: a token is appended to its request and counted in the table by array
operations; only the requests whose token may end them (a stop token id, the length
limit), that keep logprobs or have a grammar (whose matcher must take every token, and
may end the request), or that a prefill instance hands on after their first token
(remote_decode) go through Request.append_output_token one by one."""

from __future__ import annotations

import numpy as np

from messages import ModelRunnerOutput, PromptLogprobs
from zmqworker.engine.in_flight import SentStep, StepsInFlight
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.running import RunningTable


def apply_tokens(
    table: RunningTable,
    in_flight: StepsInFlight,
    step: SentStep,
    output: ModelRunnerOutput,
    max_model_len: int,
) -> tuple[list[Request], list[int], list[int]]:
    """The requests that got a token (in the output's order), the positions of those it
    finished, and of those it finished to go on elsewhere (remote_decode, not ended by
    their own rules: their KV is to be held for the decode instance). Requests no longer
    running (finished or aborted while the step ran) drop their tokens."""
    if output.prompt_logprobs is not None:  # before a request's first token may end it
        take_prompt_logprobs(table, output.prompt_logprobs)
    handles, tokens = output.req_handles, output.sampled_token_ids
    handle_list, step_list = handles.tolist(), step.handles.tolist()
    if len(handle_list) != len(tokens) or (
        handle_list != step_list and sorted(handle_list) != sorted(step_list)
    ):
        raise RuntimeError(
            f"ModelRunnerOutput names handles {sorted(handle_list)} with {len(tokens)} "
            f"tokens; the step scheduled {sorted(step_list)}"
        )
    samples = in_flight.samples(step, handles)  # None: it samples for all of them
    positions = table.position_of_handle[handles]
    position_list, token_list = positions.tolist(), tokens.tolist()
    rows = None  # the output's row of each token kept, where some are dropped
    if samples is not None or min(position_list, default=0) < 0 or min(token_list, default=0) < 0:
        samples = np.ones(len(handles), bool) if samples is None else samples
        _check(table, handles, tokens, positions, samples)
        rows = ((positions >= 0) & samples).nonzero()[0]
        positions, tokens = positions[rows], tokens[rows]
        position_list, token_list = positions.tolist(), tokens.tolist()
    changed = [table.requests[p] for p in position_list]
    look = table.may_finish(positions, tokens)
    if not look.any():
        table.append_tokens(positions, token_list)
        return changed, [], []
    plain = ~look
    table.append_tokens(
        positions[plain], [t for t, p in zip(token_list, plain.tolist(), strict=True) if p]
    )
    finished: list[int] = []
    held: list[int] = []
    for i in look.nonzero()[0].tolist():
        position, request = position_list[i], changed[i]
        table.known[position] += 1
        row = i if rows is None else int(rows[i])
        if request.append_output_token(token_list[i], max_model_len, output.logprobs, row):
            finished.append(position)
        elif request.remote_decode:
            request.finish(FinishReason.LENGTH)
            held.append(position)
    return changed, finished, held


def take_prompt_logprobs(table: RunningTable, prompt: PromptLogprobs) -> None:
    """Each running request's rows of a step's prompt logprobs (a request no longer
    running drops its)."""
    counts = prompt.num_rows.tolist()
    if sum(counts) != len(prompt.rows.logprob_token_ids) or not (
        len(counts) == len(prompt.req_handles) == len(prompt.first_positions)
    ):
        raise RuntimeError(
            f"PromptLogprobs: {len(prompt.req_handles)} handles, {len(counts)} row counts "
            f"adding up to {sum(counts)}, {len(prompt.rows.logprob_token_ids)} rows"
        )
    positions = table.position_of_handle[prompt.req_handles].tolist()
    start = 0
    for position, first, count in zip(
        positions, prompt.first_positions.tolist(), counts, strict=True
    ):
        if position >= 0:
            request = table.requests[position]
            if request.prompt_logprobs is None:
                raise RuntimeError(f"prompt logprobs for {request.req_id!r}, which asked none")
            request.prompt_logprobs.add(first, prompt.rows, start, count)
        start += count


def _check(
    table: RunningTable,
    handles: np.ndarray,
    tokens: np.ndarray,
    positions: np.ndarray,
    samples: np.ndarray,
) -> None:
    """A token for each running request the step samples, and only for those."""
    running = positions >= 0
    for bad, what in (
        (running & samples & (tokens < 0), "no token sampled for {}"),
        (running & ~samples & (tokens >= 0), "a token for {} in the middle of its prefill"),
    ):
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            request = table.requests[positions[row]]
            raise RuntimeError(what.format(f"{request.req_id!r} (handle {handles[row]})"))
