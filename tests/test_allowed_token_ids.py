"""allowed_token_ids piece by piece: SamplingParams' checks (vLLM's: non-empty, every id a
token id; the vocabulary's bound where the run is known), and the per-row bitmask
(allowed_rows.py through penalty_rows.py) that sets every other logit to -inf, by the torch
ops and by the Triton kernel (through the interpreter on the CPU), composed with
logit_bias and the bans, uploaded once while the batch is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from messages import SamplingParams
from tests.runner_helpers import DEVICE
from tests.test_penalties import VOCAB, fused_params, random_logits
from zmqworker.engine.request_message import check_lists, check_token_ids
from zmqworker.executor.message_limits import LARGE_VOCAB
from zmqworker.model_runner.penalties import apply_penalties
from zmqworker.model_runner.penalty_rows import PenaltyRows


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "allowed_token_ids is empty: it would allow no token (None allows every token)"),
        ([3, -1], "allowed_token_ids: token id -1 is outside the vocabulary (token ids are in "),
        ([2**31], "allowed_token_ids: token id 2147483648 is outside the vocabulary"),
        ([1, "2"], "Expected `int`, got `str` - at `$.allowed_token_ids[1]`"),
    ],
)
def test_bad_allowed_token_ids_are_refused_when_the_params_are_made(ids, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(allowed_token_ids=ids)
    assert str(err.value).startswith(message), err.value


def test_allowed_token_ids_outside_the_vocabulary_are_refused_naming_the_id():
    params = SamplingParams(allowed_token_ids=[5, 300, 7])
    assert params.token_id_outside(300) == ("allowed_token_ids", 300)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token id 300 is outside the "):
        check_token_ids(params, 300)
    with pytest.raises(ValueError, match=r"allowed_token_ids holds 4 ids, more than the vocab"):
        check_token_ids(SamplingParams(allowed_token_ids=[1, 1, 2, 2]), 3)


def test_long_lists_are_refused_where_the_vocabulary_is_not_known():
    """The bound the workers' step room counts then (message_limits.LARGE_VOCAB ids)."""
    many = LARGE_VOCAB + 1
    with pytest.raises(ValueError, match=rf"^allowed_token_ids holds {many} ids, more than"):
        check_lists(SamplingParams(allowed_token_ids=[1] * many))
    with pytest.raises(ValueError, match=rf"^logit_bias holds {many} ids, more than"):
        check_lists(SamplingParams(logit_bias=dict.fromkeys(range(many), 1.0)))
    check_lists(SamplingParams(allowed_token_ids=[1] * LARGE_VOCAB))


def test_numpy_ids_and_a_tuple_are_taken_as_a_list():
    params = SamplingParams(allowed_token_ids=(np.int64(4), 9))
    assert params.allowed_token_ids == [4, 9] and type(params.allowed_token_ids[0]) is int
    assert SamplingParams().allowed_token_ids is None


def rows_with(params: list[SamplingParams]) -> tuple[PenaltyRows, np.ndarray]:
    state = PenaltyRows(8, VOCAB, DEVICE)
    rows = np.array([6, 1, 4, 0][: len(params)], np.int64)
    for row, each in zip(rows, params, strict=True):
        state.add(int(row), each, np.array([1, 2, 3], np.int32), 3, [2])
    state.flush()
    return state, rows


def sample_step(state: PenaltyRows, rows: np.ndarray, min_tokens_done: bool = True):
    num_tokens = np.full(8, 20 if min_tokens_done else 3)
    return state.step(rows, num_tokens, np.full(8, 3), np.zeros((8, 64), np.int32))


@pytest.mark.parametrize("fused", fused_params())
def test_only_the_allowed_tokens_keep_their_logits(fused):
    allowed = [0, 31, 32, 150, 299]  # word edges, and the partial last word
    params = [
        SamplingParams(allowed_token_ids=allowed),
        SamplingParams(),  # no mask: its row is left as it is
        SamplingParams(allowed_token_ids=[7, 8], logit_bias={8: 3.0, 9: 50.0}),
        SamplingParams(allowed_token_ids=[299], repetition_penalty=1.5),
    ]
    state, rows = rows_with(params)
    step = sample_step(state, rows)
    assert step is not None and step.allowed is not None
    logits = random_logits(len(rows), 4, 3.0)
    got = logits.clone()
    apply_penalties(got, step, fused)
    got = got.cpu()
    for i, ids in enumerate([allowed, None, [7, 8], [299]]):
        if ids is None:
            assert torch.equal(got[i], logits[i].cpu())
            continue
        kept = torch.zeros(VOCAB, dtype=torch.bool)
        kept[ids] = True
        assert torch.isneginf(got[i][~kept]).all()
        assert torch.isfinite(got[i][kept]).all()
    assert got[0][allowed].equal(logits[0].cpu()[allowed])
    assert got[2][8] == logits[2, 8].cpu() + 3.0  # the bias of an allowed token still adds
    assert got[2].argmax() in (7, 8)  # the bias of a banned one (9) does not lift it


@pytest.mark.parametrize("fused", fused_params())
def test_an_empty_intersection_with_the_bans_leaves_no_token_and_nothing_fails(fused):
    """min_tokens bans EOS (2), the only token allowed: every logit is -inf (the user's
    problem, as in vLLM), and the mask and the bans still apply without an error."""
    params = SamplingParams(allowed_token_ids=[2], min_tokens=4, max_tokens=8)
    state, rows = rows_with([params])
    step = sample_step(state, rows, min_tokens_done=False)
    assert step is not None and step.allowed is not None and step.bans is not None
    logits = random_logits(1, 5, 1.0)
    apply_penalties(logits, step, fused)
    assert torch.isneginf(logits).all()


def test_a_step_like_the_one_before_uses_its_mask_again_and_a_new_row_gets_its_own():
    state, rows = rows_with([SamplingParams(allowed_token_ids=[5]), SamplingParams()])
    first = sample_step(state, rows)
    assert sample_step(state, rows) is first  # no upload, no gather
    state.remove(6)
    state.add(6, SamplingParams(allowed_token_ids=[9]), np.array([1], np.int32), 1, [])
    state.flush()
    second = sample_step(state, rows)
    assert second is not first and second is not None and second.allowed is not None
    logits = torch.zeros(2, VOCAB, device=DEVICE)
    apply_penalties(logits, second, fused=False)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [9]
    assert torch.isfinite(logits[1]).all()
    state.remove(6)
    assert sample_step(state, rows) is None  # no row uses anything: nothing per step


def test_the_dummy_step_masks_nothing():
    state = PenaltyRows(4, VOCAB, DEVICE)
    step = state.dummy_step(3)
    assert step.allowed is not None
    logits = random_logits(3, 6, 1.0)
    got = logits.clone()
    apply_penalties(got, step, fused=False)
    assert torch.isfinite(got[:, 1:]).all()  # token 0: the dummy step's ban


def test_the_bitmasks_are_part_of_the_memory_held_from_the_start():
    state = PenaltyRows(8, VOCAB, DEVICE)
    assert state.nbytes == (8 * VOCAB + 2 * 8 * 10) * 4  # counts, prompt bits, allowed bits
