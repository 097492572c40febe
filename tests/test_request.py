"""Request state: stop rules (max_tokens, EOS, stop ids, stop strings), text, timings."""

from __future__ import annotations

import pytest
from engine_helpers import byte_level_tokenizer

from messages import SamplingParams
from zmqworker.engine.detokenizer import IncrementalDetokenizer
from zmqworker.engine.request import FinishReason, Request, RequestStatus


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def text_request(tok, prompt: str, **params) -> Request:
    ids = tok.encode(prompt)
    return Request(
        "r",
        ids,
        SamplingParams(**params),
        eos_token_ids=[tok.eos_token_id],
        detokenizer=IncrementalDetokenizer(tok, ids),
    )


def feed(request: Request, tok, text: str, max_model_len: int = 1000) -> list[str]:
    """Append text's tokens until the request finishes; the streamed text pieces."""
    pieces = []
    for token in tok.encode(text):
        done = request.append_output_token(token, max_model_len)
        pieces.append(request.take_delta()[1])
        if done:
            break
    return pieces


def test_max_tokens_finishes_with_length_and_timings():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3), arrival_time=10.0)
    assert not request.append_output_token(5, 100, now=11.0)
    assert not request.append_output_token(6, 100, now=12.0)
    assert request.append_output_token(7, 100, now=14.0)
    assert request.status is RequestStatus.FINISHED
    assert request.finish_reason is FinishReason.LENGTH
    assert request.output_token_ids == [5, 6, 7] and request.all_token_ids == [1, 2, 3, 5, 6, 7]
    timings = request.timings()
    assert (timings.ttft, timings.tpot, timings.total) == (1.0, 1.5, 4.0)
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


def test_stop_token_id_stops_and_its_text_is_left_out(tok):
    period = tok.encode(".")[0]
    request = text_request(tok, "The capital of France is", stop_token_ids=[period])
    pieces = feed(request, tok, " Paris. The end")
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == period
    assert request.output_text == " Paris" and "".join(pieces) == " Paris"
    assert request.output_token_ids[-1] == period


def test_eos_text_is_left_out(tok):
    request = text_request(tok, "Hello", max_tokens=50)
    for token in tok.encode(" world"):
        request.append_output_token(token, 100)
    assert request.append_output_token(tok.eos_token_id, 100)
    assert request.output_text == " world" and request.stop_reason == tok.eos_token_id


@pytest.mark.parametrize("stop", [".", ". The", "is. The"])
def test_stop_string_is_trimmed_even_across_tokens(tok, stop):
    request = text_request(tok, "The capital of France is", stop=[stop, "never"], max_tokens=50)
    pieces = feed(request, tok, " Paris. The end. More text")
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == stop
    expected = " Paris. The end. More text"
    expected = expected[: expected.find(stop)]
    assert request.output_text == expected
    # Streamed text never showed the stop string's start, and adds up to the output.
    assert "".join(pieces) == expected


def test_stream_holds_back_a_possible_stop_string_start(tok):
    request = text_request(tok, "The", stop=["end!"], max_tokens=50)
    streamed = ""
    for token in tok.encode(" end of the end"):
        request.append_output_token(token, 1000)
        streamed += request.take_delta()[1]
        assert len(streamed) <= max(0, len(request.output_text) - 3)
        assert request.output_text.startswith(streamed)
    assert not request.is_finished


def test_text_of_unfinished_request_streams_completely_once_finished(tok):
    # The last token cuts the emoji: its bytes come out as U+FFFD at the finish.
    ids = tok.encode(" café 😀")
    request = text_request(tok, "Hi", stop=["zzz"], max_tokens=len(ids) - 1)
    tokens, text = [], ""
    while not request.is_finished:
        request.append_output_token(ids[len(tokens)], 1000)
        new_tokens, new_text = request.take_delta()
        tokens += new_tokens
        text += new_text
    assert tokens == request.output_token_ids and text == request.output_text
    assert text == tok.decode(ids[:-1]) and text.endswith("\ufffd")
    assert request.take_delta() == ([], "")


def test_bad_requests_are_refused(tok):
    with pytest.raises(ValueError, match="empty"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Request("r", [1], SamplingParams(stop=["x"]))


def test_min_tokens_lets_no_stop_end_the_first_tokens(tok):
    """vLLM's rule: EOS, a stop id and a stop string end the output only from token
    min_tokens + 1 on; before, the token and its text are output like any other."""
    held = Request("r", [1], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=[2])
    assert not held.append_output_token(2, 100)
    assert not held.append_output_token(2, 100)
    assert held.append_output_token(2, 100) and held.output_token_ids == [2, 2, 2]
    period = tok.encode(".")[0]
    request = text_request(tok, "The", stop=["."], stop_token_ids=[period], min_tokens=3)
    feed(request, tok, " Paris. The end. More")
    stop = tok.encode(" Paris. The end. More").index(period, 3)
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == period
    assert len(request.output_token_ids) == stop + 1 and request.output_text == " Paris. The end"


def test_request_params_tokenize_bad_words_with_and_without_a_space(tok):
    """A bad word is banned as it starts the text and as it follows a space, where the
    spaced form is another sequence of as many tokens ("he": one token either way);
    "ve" after a space is two tokens (a space, then "ve"): banning "ve" covers it."""
    from zmqworker.engine.request_params import request_params

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
    with pytest.raises(ValueError, match=r"bad_words_token_ids\[0\] holds token id 7, outside"):
        request_params(SamplingParams(bad_words_token_ids=[[7]]), None, 5, 20)
