"""A later pipeline stage takes a step only with the previous stage's tensors in hand and
checked whole (their names, token count, hidden size and dtype): a step whose tensors do
not fit, or never come because the previous stage refused it, is refused by name and
leaves the batch as it was, as the previous stage's is (docs/protocol.md: a step that
fails leaves the worker's batch as it was)."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from messages import CachedRequestData, IntermediateTensors, NewRequestData, SchedulerOutput
from tests.runner_helpers import GREEDY, checkpoint, hf_greedy, make_runner, pp_state
from zmqworker.distributed.pp_channel import PendingTensors
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.model_runner import ModelRunner

PROMPT = (5, 17, 3, 42, 8)


def new(handle: int, prompt: tuple[int, ...], blocks: list[int]) -> NewRequestData:
    return NewRequestData(
        f"r{handle}",
        handle,
        np.array(prompt, np.int32),
        GREEDY,
        np.array(blocks, np.int32),
        len(prompt),
    )


def prefill(*reqs: NewRequestData, cached: CachedRequestData | None = None) -> SchedulerOutput:
    cached = cached or CachedRequestData.empty()
    total = sum(r.num_scheduled_tokens for r in reqs) + int(cached.num_scheduled_tokens.sum())
    return SchedulerOutput(list(reqs), cached, total)


def arrived(call_id: int, tensors: dict[str, torch.Tensor]) -> PendingTensors:
    pending = PendingTensors(call_id, 0, until=time.monotonic() + 5.0)
    pending.deliver(IntermediateTensors(tensors))
    return pending


def tokens(out: object) -> list[int]:
    assert isinstance(out, AsyncModelRunnerOutput)
    return out.get_output().sampled_token_ids.tolist()


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint()


def _bad(runner: ModelRunner, how: str) -> tuple[dict[str, torch.Tensor], str]:
    """Tensors for a step of len(PROMPT) tokens, wrong as how says, and the refusal."""
    model = runner.model
    n, width, dtype = len(PROMPT), model.hidden_size, model.dtype
    other_dtype = torch.float16 if dtype != torch.float16 else torch.float32
    shape = {"tokens": (n - 2, width), "width": (n, width + 3)}.get(how, (n, width))
    hidden = torch.zeros(shape, dtype=other_dtype if how == "dtype" else dtype)
    tensors = {"hidden_states": hidden, "residual": hidden.clone()}
    if how == "missing":
        del tensors["residual"]
        return tensors, r"\['residual'\] missing"
    if how == "unknown":
        tensors["aux"] = hidden.clone()
        return tensors, r"\['aux'\] unknown"
    if how == "dtype":
        return tensors, f"'hidden_states' has dtype {other_dtype}, expected the model's {dtype}"
    return tensors, f"'hidden_states' has shape \\({shape[0]}, {shape[1]}\\), expected {n} tokens"


@pytest.mark.parametrize("how", ["tokens", "width", "dtype", "missing", "unknown"])
def test_tensors_that_do_not_fit_are_refused_before_the_batch_changes(path, how) -> None:
    stage1 = make_runner(path, pp_state(1))
    so = prefill(new(7, PROMPT, [0, 1]))
    copies: list[int] = []
    copy = functools.partial(copies.append, 1)
    tensors, refusal = _bad(stage1, how)
    with pytest.raises(ValueError, match=refusal):
        stage1.execute_model(so, arrived(1, tensors), before_apply=copy)
    with pytest.raises(ValueError, match=refusal):  # not waited for: the same checks
        stage1.execute_model(so, IntermediateTensors(tensors), before_apply=copy)
    assert len(stage1.batch) == 0 and copies == []
    # The engine may send the step again, with tensors that fit.
    stage0 = make_runner(path, pp_state(0))
    sent = stage0.execute_model(so)
    assert isinstance(sent, IntermediateTensors)
    out = stage1.execute_model(so, arrived(2, dict(sent.tensors)), before_apply=copy)
    assert tokens(out) == hf_greedy(path, PROMPT, 1) and copies == [1]


def test_a_step_the_previous_stage_refused_leaves_both_stages_alike(path) -> None:
    """Stage 0 refuses a step and sends nothing: stage 1 fails it when the wait ends,
    with nothing of it applied, so the engine can send it again to both."""
    stage0, stage1 = make_runner(path, pp_state(0)), make_runner(path, pp_state(1))
    first = prefill(new(7, PROMPT, [0, 1]))
    sent = stage0.execute_model(first)
    assert isinstance(sent, IntermediateTensors)
    (token,) = tokens(stage1.execute_model(first, arrived(1, dict(sent.tensors))))
    # Stage 0 was not sent the token it would compute: it refuses the step.
    cached = CachedRequestData.build([7], [len(PROMPT)], [1])
    refused = prefill(new(8, (4, 4), [2]), cached=cached)
    with pytest.raises(ValueError, match="'r7' \\(handle 7\\)"):
        stage0.execute_model(refused)
    with pytest.raises(TimeoutError, match="no intermediate tensors"):
        stage1.execute_model(refused, PendingTensors(2, 0, until=time.monotonic() + 0.1))
    assert stage1.batch.row_of.keys() == stage0.batch.row_of.keys() == {7}
    # Sent again with the token, the step runs on both stages.
    cached = CachedRequestData.build([7], [len(PROMPT)], [1], None, [[token]])
    again = prefill(new(8, (4, 4), [2]), cached=cached)
    sent = stage0.execute_model(again)
    assert isinstance(sent, IntermediateTensors)
    out = tokens(stage1.execute_model(again, arrived(3, dict(sent.tensors))))
    assert out == [hf_greedy(path, PROMPT, 2)[1], hf_greedy(path, (4, 4), 1)[0]]
