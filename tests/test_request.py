"""A request on both sides of the engine core's boundary: the engine core's stop rules
(max_tokens, max_model_len, EOS, stop ids) and the outputs it hands on; the client's text,
stop strings, held-back stream, logprobs and timings built from those outputs."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import byte_level_tokenizer

from messages import (
    EngineCoreStats,
    FinishedOutput,
    FirstOutput,
    LogprobsLists,
    SamplingParams,
)
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.request import FinishReason, Request, RequestStatus
from zmqworker.frontend.detokenizer import IncrementalDetokenizer
from zmqworker.frontend.output_processor import OutputProcessor
from zmqworker.frontend.request_state import RequestState

STATS = EngineCoreStats(1, 0, 8, 4, 0, 0)


def take_output(request: Request):
    """What the engine core sends its client of this request now."""
    return client_outputs(0, [request], STATS)


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


class Both:
    """One request as the engine core and its client hold it: each token goes through the
    engine core's Request, and its output to the client's RequestState."""

    def __init__(self, tok, prompt: str, max_model_len: int = 1000, **params) -> None:
        ids = tok.encode(prompt)
        params = SamplingParams(**params)
        self.engine = Request("r", ids, params, eos_token_ids=[tok.eos_token_id])
        self.client = RequestState("r", prompt, ids, params, IncrementalDetokenizer(tok, ids))
        self.processor = OutputProcessor()
        self.processor.add(self.client)
        self.max_model_len = max_model_len

    def add(self, token: int) -> str:
        """Feed one token; the text the stream shows for it."""
        self.engine.append_output_token(token, self.max_model_len)
        processed = self.processor.process(take_output(self.engine))
        if processed.stopped:
            self.engine.finish(FinishReason.ABORT)  # the client aborts it on a stop string
        [out] = processed.outputs
        return out.new_text

    def feed(self, text_or_ids) -> list[str]:
        """Feed tokens until the request finishes; the streamed text pieces."""
        pieces = []
        for token in text_or_ids:
            pieces.append(self.add(token))
            if self.client.finished:
                break
        return pieces


# -- the engine core's side ---------------------------------------------------------------


def test_max_tokens_finishes_with_length_and_the_output_says_so():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3))
    assert not request.append_output_token(5, 100)
    assert not request.append_output_token(6, 100)
    first = take_output(request)
    assert first.new_token_ids.tolist() == [5, 6] and first.token_offsets.tolist() == [0, 2]
    assert first.first[0].index == 0 and not first.finished
    assert request.append_output_token(7, 100)
    assert request.status is RequestStatus.FINISHED
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [5, 6, 7] and request.all_token_ids == [1, 2, 3, 5, 6, 7]
    out = take_output(request)
    assert out.new_token_ids.tolist() == [7] and out.token_offsets is None and not out.first
    assert out.finished == [FinishedOutput(0, "length", None)]
    with pytest.raises(RuntimeError, match="finished"):
        request.append_output_token(8, 100)


def test_max_model_len_finishes_with_length():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
    assert not request.append_output_token(5, max_model_len=5)
    assert request.append_output_token(5, max_model_len=5)
    assert request.finish_reason is FinishReason.LENGTH


def test_eos_stops_unless_ignored():
    request = Request("r", [1], SamplingParams(max_tokens=10), eos_token_ids=[2])
    assert not request.append_output_token(5, 100)
    assert request.append_output_token(2, 100)
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 2)
    assert request.output_token_ids == [5, 2]
    ignoring = Request("r", [1], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=[2])
    assert not ignoring.append_output_token(2, 100)
    assert not ignoring.append_output_token(2, 100)
    assert ignoring.append_output_token(2, 100)
    assert ignoring.finish_reason is FinishReason.LENGTH


def test_the_output_carries_each_new_token_s_logprobs_row():
    request = Request("r", [1], SamplingParams(max_tokens=5, logprobs=1))
    step = LogprobsLists(
        logprob_token_ids=np.array([[9, 9, 4], [7, 3, 7]], np.int32),
        logprobs=np.array([[-0.5, -0.5, -2.0], [-1.0, -0.25, -1.0]], np.float32),
        sampled_token_ranks=np.array([1, 2], np.int32),
    )
    request.append_output_token(9, 100, step, row=0)
    request.append_output_token(7, 100, step, row=1)
    [out] = take_output(request).logprobs
    assert out.rows.logprob_token_ids.tolist() == [[9, 9], [7, 3]]  # the token, top 1
    assert out.rows.sampled_token_ranks.tolist() == [1, 2]
    assert take_output(request).logprobs == []  # taken
    with pytest.raises(RuntimeError, match="does not hold token 8"):
        request.append_output_token(8, 100, step, row=0)


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="empty"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        RequestState("r", None, [1], SamplingParams(stop=["x"]), None)


# -- the client's side --------------------------------------------------------------------


def test_stop_token_id_stops_and_its_text_is_left_out(tok):
    period = tok.encode(".")[0]
    both = Both(tok, "The capital of France is", stop_token_ids=[period])
    pieces = both.feed(tok.encode(" Paris. The end"))
    out = both.client.output()
    assert out.finish_reason == "stop" and out.stop_reason == period
    assert out.text == " Paris" and "".join(pieces) == " Paris"
    assert out.token_ids[-1] == period


def test_eos_text_is_left_out(tok):
    both = Both(tok, "Hello", max_tokens=50)
    both.feed([*tok.encode(" world"), tok.eos_token_id])
    out = both.client.output()
    # vLLM's stop_reason: a stop token id of the request's, None for EOS
    assert out.text == " world" and out.finish_reason == "stop" and out.stop_reason is None


@pytest.mark.parametrize("stop", [".", ". The", "is. The"])
def test_stop_string_is_trimmed_even_across_tokens(tok, stop):
    both = Both(tok, "The capital of France is", stop=[stop, "never"], max_tokens=50)
    pieces = both.feed(tok.encode(" Paris. The end. More text"))
    out = both.client.output()
    assert out.finish_reason == "stop" and out.stop_reason == stop
    expected = " Paris. The end. More text"
    expected = expected[: expected.find(stop)]
    assert out.text == expected
    # Streamed text never showed the stop string's start, and adds up to the output.
    assert "".join(pieces) == expected
    assert both.engine.finish_reason is FinishReason.ABORT  # the engine core was told


def test_stream_holds_back_a_possible_stop_string_start(tok):
    both = Both(tok, "The", stop=["end!"], max_tokens=50)
    streamed = ""
    for token in tok.encode(" end of the end"):
        streamed += both.add(token)
        assert len(streamed) <= max(0, len(both.client.output_text) - 3)
        assert both.client.output_text.startswith(streamed)
    assert not both.client.finished


def test_text_of_unfinished_request_streams_completely_once_finished(tok):
    # The last token cuts the emoji: its bytes come out as U+FFFD at the finish.
    ids = tok.encode(" café 😀")
    both = Both(tok, "Hi", stop=["zzz"], max_tokens=len(ids) - 1)
    text = "".join(both.feed(ids))
    out = both.client.output()
    assert out.token_ids == ids[:-1] and text == out.text
    assert text == tok.decode(ids[:-1]) and text.endswith("\ufffd")
    assert (out.new_token_ids, out.new_text) == ([], "")


def test_min_tokens_lets_no_stop_end_the_first_tokens(tok):
    """vLLM's rule: EOS, a stop id and a stop string end the output only from token
    min_tokens + 1 on; before, the token and its text are output like any other."""
    held = Request("r", [1], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=[2])
    assert not held.append_output_token(2, 100)
    assert not held.append_output_token(2, 100)
    assert held.append_output_token(2, 100) and held.output_token_ids == [2, 2, 2]
    period = tok.encode(".")[0]
    both = Both(tok, "The", stop=["."], stop_token_ids=[period], min_tokens=3)
    ids = tok.encode(" Paris. The end. More")
    text = "".join(both.feed(ids))
    stop = ids.index(period, 3)
    out = both.client.output()
    assert (out.finish_reason, out.stop_reason) == ("stop", period)
    assert len(out.token_ids) == stop + 1 and text == " Paris. The end"


def test_request_params_tokenize_bad_words_with_and_without_a_space(tok):
    """A bad word is banned as it starts the text and as it follows a space, where the
    spaced form is another sequence of as many tokens ("he": one token either way);
    "ve" after a space is two tokens (a space, then "ve"): banning "ve" covers it."""
    from zmqworker.frontend.request_params import request_params

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert len(ids("he")) == len(ids(" he")) == 1 and ids("he") != ids(" he")
    assert ids(" ve") == [*ids(" "), *ids("ve")]
    params = SamplingParams(bad_words=["he", "  ve"], bad_words_token_ids=[[7]])
    resolved = request_params(params, tok, len(tok), max_logprobs=20)
    assert resolved.bad_words == []
    assert resolved.bad_words_token_ids == [[7], ids("he"), ids(" he"), ids("ve")]
    assert request_params(resolved, tok, len(tok), 20) == resolved  # checked again: the same
    with pytest.raises(ValueError, match="bad_words need the model's tokenizer"):
        request_params(params, None, 320, 20)
    with pytest.raises(
        ValueError, match=r"bad_words_token_ids: token id 7 is outside the vocabulary \[0, 5\)"
    ):
        request_params(SamplingParams(bad_words_token_ids=[[7]]), None, 5, 20)
    # With no max_logprobs (-1), the vocabulary bounds the top-n.
    with pytest.raises(ValueError, match="logprobs=6 is more than the vocabulary's 5 tokens"):
        request_params(SamplingParams(logprobs=6), None, 5, -1)


def test_timings_and_logprobs_texts(tok):
    ids = tok.encode("Hi")
    state = RequestState(
        "r", "Hi", ids, SamplingParams(logprobs=1), IncrementalDetokenizer(tok, ids), 10.0
    )
    hello = tok.encode(" Hello")

    def rows(token: int) -> LogprobsLists:
        return LogprobsLists(
            logprob_token_ids=np.array([[token, ids[0]]], np.int32),
            logprobs=np.array([[-0.5, -1.5]], np.float32),
            sampled_token_ranks=np.array([1], np.int32),
        )

    state.apply([hello[0]], 11.0, first=FirstOutput(0, 0, 0.5), logprobs=rows(hello[0]))
    state.apply([5], 14.0, FinishedOutput(0, "length"), logprobs=rows(5))
    out = state.output()
    assert (out.timings.ttft, out.timings.tpot, out.timings.total) == (1.0, 3.0, 4.0)
    assert out.timings.queue == 0.5
    with pytest.raises(RuntimeError, match="asked for logprobs"):
        state.apply([5], 15.0)
    [position, _] = out.logprobs or [None, None]
    assert position.sampled.text == tok.decode([hello[0]]) and position.rank == 1
    assert [t.token_id for t in position.top] == [ids[0]]
