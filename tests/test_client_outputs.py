"""A step's outputs as columns, both sides: the engine core builds EngineCoreOutputs from
its requests (engine/client_outputs.py), the bytes go through the codec, and the client
applies them (frontend/output_processor.py): bulk requests in one loop, the others one by
one. A message whose columns disagree does not decode, and says what was wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine_helpers import byte_level_tokenizer

from messages import (
    Decoder,
    Encoder,
    EngineCoreOutputs,
    EngineCoreStats,
    LogprobsLists,
    ProtocolError,
    SamplingParams,
)
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.request import FinishReason, Request
from zmqworker.frontend.detokenizer import IncrementalDetokenizer
from zmqworker.frontend.output_processor import OutputProcessor, Processed
from zmqworker.frontend.request_state import RequestState

STATS = EngineCoreStats(4, 0, 64, 32, 0, 0)
MAX_MODEL_LEN = 1000


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


class Pair:
    """Requests as the engine core and its client hold them; each step goes through the
    wire (the codec's bytes) from one to the other."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.engine: dict[str, Request] = {}
        self.processor = OutputProcessor()
        self.encoder, self.decoder = Encoder(), Decoder()

    def add(
        self, request_id: str, prompt: str, streamed: bool = False, first: str = "", **params
    ) -> None:
        """first: the sample whose prompt logprobs are this one's too."""
        ids = self.tok.encode(prompt)
        sampling = SamplingParams(**{"max_tokens": 50, **params})
        self.engine[request_id] = Request(
            request_id, ids, sampling, eos_token_ids=[self.tok.eos_token_id]
        )
        detok = IncrementalDetokenizer(self.tok, ids)
        state = RequestState(
            request_id,
            prompt,
            ids,
            sampling,
            detok,
            streamed=streamed,
            prompt_logprobs_from=self.processor.states[first] if first else None,
            eos_token_id=self.tok.eos_token_id,
        )
        self.processor.add(state)

    def step(self, tokens: dict[str, list[int]], rows: LogprobsLists | None = None) -> Processed:
        """Each request samples its tokens (row i of rows: the i-th token of the step);
        the client applies the step's outputs."""
        row = 0
        for request_id, ids in tokens.items():
            for token in ids:
                request = self.engine[request_id]
                if not request.is_finished:
                    request.append_output_token(token, MAX_MODEL_LEN, rows, row)
                row += 1
        changed = [self.engine[i] for i in tokens]
        msg = self.decoder.decode(self.encoder.encode(client_outputs(0, changed, STATS)))
        assert isinstance(msg, EngineCoreOutputs)
        processed = self.processor.process(msg)
        for request_id in processed.stopped:  # the client aborts it in the engine core
            self.engine[request_id].finish(FinishReason.ABORT)
        for request in changed:
            if request.is_finished:
                del self.engine[request.req_id]
        return processed


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- bulk application -----------------------------------------------------------------


def test_decode_steps_go_one_token_each_and_only_finished_outputs_are_built(tok):
    pair = Pair(tok)
    words = {"a": " the river runs past the mill", "b": " bells ring across the valley"}
    ids = {name: text_ids(tok, text) for name, text in words.items()}
    for name in words:
        pair.add(name, "Once", max_tokens=len(ids[name]))
    states = dict(pair.processor.states)
    outputs = []
    for i in range(max(len(v) for v in ids.values())):
        step = {name: v[i : i + 1] for name, v in ids.items() if i < len(v)}
        processed = pair.step(step)
        outputs += processed.outputs
        assert all(o.finished for o in processed.outputs)  # nobody streams
    assert all(state.bulk is False for state in states.values())  # both finished
    by_id = {o.request_id: o for o in outputs}
    for name, text in words.items():
        out = by_id[name]
        assert out.token_ids == ids[name] and out.text == text
        assert out.finish_reason == "length" and out.new_text == text
        assert out.timings.ttft >= 0 and out.timings.total >= out.timings.ttft
    assert not pair.processor.states


def test_several_tokens_of_a_step_come_with_offsets(tok):
    pair = Pair(tok)
    pair.add("a", "Hi")
    pair.add("b", "Hi", streamed=True)
    first = text_ids(tok, " one two")
    second = text_ids(tok, " three")
    pair.step({"a": first[:1], "b": first[:1]})
    processed = pair.step({"a": first[1:] + second, "b": first[1:] + second})
    [streamed] = processed.outputs  # the bulk one builds no output until it ends
    assert streamed.request_id == "b" and streamed.new_token_ids == first[1:] + second
    assert pair.processor.states["a"].output_token_ids == first + second


def test_stop_token_text_is_left_out_in_bulk_as_token_by_token(tok):
    period = text_ids(tok, ".")[0]
    pieces = text_ids(tok, " Paris. The end")
    results = {}
    for streamed in (False, True):
        pair = Pair(tok)
        pair.add("r", "The capital of France is", streamed, stop_token_ids=[period])
        outs = []
        for token in pieces:
            outs += pair.step({"r": [token]}).outputs
            if "r" not in pair.engine:
                break
        final = outs[-1]
        assert final.finished and final.stop_reason == period and final.token_ids[-1] == period
        results[streamed] = final.text
    assert results[False] == results[True] == " Paris"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_tokenizer_s_eos_is_no_stop_reason_even_listed_in_stop_token_ids(tok, ignore_eos):
    """vLLM checks EOS before stop_token_ids (OpenAI clients often list it there): it was
    reported as the stop reason. With ignore_eos only the listing ends the output."""
    eos = tok.eos_token_id
    pair = Pair(tok)
    pair.add("r", "Hi", stop_token_ids=[eos], ignore_eos=ignore_eos)
    pair.step({"r": [text_ids(tok, " a")[0]]})
    [final] = pair.step({"r": [eos]}).outputs
    assert final.finished and final.finish_reason == "stop"
    assert final.stop_reason == (eos if ignore_eos else None)


def test_text_made_at_the_end_equals_the_streamed_text(tok):
    """A cut multi-byte character at the end comes out as U+FFFD either way."""
    ids = text_ids(tok, " café 😀 naïve")[:-1]
    texts = {}
    for streamed in (False, True):
        pair = Pair(tok)
        pair.add("r", "Hi", streamed, max_tokens=len(ids))
        outs = [o for t in ids for o in pair.step({"r": [t]}).outputs]
        texts[streamed] = outs[-1].text
        if streamed:
            assert "".join(o.new_text for o in outs) == outs[-1].text
    assert texts[False] == texts[True] == tok.decode(ids)


def test_stop_strings_take_the_per_request_path_and_stop_there(tok):
    pair = Pair(tok)
    pair.add("plain", "The")
    pair.add("stops", "The", stop=[". The"])
    ids = text_ids(tok, " Paris. The end")
    stopped = []
    for token in ids:
        processed = pair.step({name: [token] for name in pair.engine})
        stopped += processed.stopped
        if processed.stopped:
            [out] = processed.outputs
            assert out.text == " Paris" and out.stop_reason == ". The"
    assert stopped == ["stops"]
    assert pair.processor.states["plain"].output_token_ids == ids


def test_logprobs_rows_go_to_their_requests(tok):
    pair = Pair(tok)
    pair.add("plain", "Hi")
    pair.add("lp", "Hi", logprobs=1)
    a, b = text_ids(tok, " ab")[:2]
    rows = LogprobsLists(
        logprob_token_ids=np.array([[a, b], [b, a]], np.int32),
        logprobs=np.array([[-0.5, -1.5], [-0.25, -2.0]], np.float32),
        sampled_token_ranks=np.array([1, 1], np.int32),
    )
    pair.step({"plain": [a], "lp": [b]}, rows)
    state = pair.processor.states["lp"]
    [position] = state.logprobs or []
    assert position.sampled.token_id == b and position.top[0].token_id == a
    assert position.sampled.logprob == -0.25 and position.sampled.text == tok.decode([b])
    assert not state.bulk and pair.processor.states["plain"].bulk


def test_n_siblings_are_requests_of_their_own(tok):
    pair = Pair(tok)
    for i in range(3):
        pair.add(f"r.{i}", "Hi", max_tokens=2)
    tokens = text_ids(tok, " a b c")
    pair.step({f"r.{i}": [tokens[i]] for i in range(3)})
    processed = pair.step({f"r.{i}": [tokens[i]] for i in range(3)})
    assert sorted((o.request_id, o.token_ids) for o in processed.outputs) == [
        (f"r.{i}", [tokens[i]] * 2) for i in range(3)
    ]


def test_samples_outputs_wait_for_the_first_samples_prompt_logprobs(tok):
    """Only the first sample asks for prompt logprobs; the others' outputs, finished or
    streamed, wait until they come with its first output, then carry them."""
    pair = Pair(tok)
    pair.add("p.0", "Hi there", prompt_logprobs=0)
    pair.add("p.1", "Hi there", first="p.0", max_tokens=1)
    pair.add("p.2", "Hi there", first="p.0", streamed=True)
    a, b = text_ids(tok, " ab")[:2]
    assert pair.step({"p.1": [a], "p.2": [a]}).outputs == []  # p.1 finished, held
    assert pair.step({"p.2": [b]}).outputs == []
    prompt = tok.encode("Hi there")
    count = len(prompt) - 1
    rows = LogprobsLists(
        logprob_token_ids=np.array(prompt[1:], np.int32)[:, None],
        logprobs=np.full((count, 1), -1.0, np.float32),
        sampled_token_ranks=np.ones(count, np.int32),
    )
    request = pair.engine["p.0"]
    assert request.prompt_logprobs is not None
    request.prompt_logprobs.add(1, rows, 0, count)
    processed = pair.step({"p.0": [a], "p.2": [a]})
    by_id = {o.request_id: o for o in processed.outputs}
    assert sorted(by_id) == ["p.1", "p.2"]  # p.0 is not streamed, and runs on
    first = pair.processor.states["p.0"].prompt_logprobs
    assert first is not None and [e and e.sampled.token_id for e in first] == [None, *prompt[1:]]
    assert by_id["p.1"].finished and by_id["p.1"].prompt_logprobs == first
    assert by_id["p.2"].new_token_ids == [a, b, a] and by_id["p.2"].prompt_logprobs == first
    assert [o.request_id for o in pair.step({"p.2": [b]}).outputs] == ["p.2"]  # not held
    pair.add("q.0", "Hi", prompt_logprobs=0)
    pair.add("q.1", "Hi", first="q.0", max_tokens=1)
    assert pair.step({"q.1": [a]}).outputs == []
    pair.processor.remove("q.1")  # aborted while held: never comes out
    pair.processor.remove("q.0")
    assert pair.step({"p.2": [b]}).outputs[0].request_id == "p.2"


def test_a_request_aborted_here_mid_stream_drops_its_late_outputs(tok):
    pair = Pair(tok)
    pair.add("kept", "Hi", streamed=True)
    pair.add("gone", "Hi", streamed=True)
    token = text_ids(tok, " a")[0]
    pair.step({"kept": [token], "gone": [token]})
    pair.processor.remove("gone")  # its caller gave up; the engine core runs it on
    processed = pair.step({"kept": [token], "gone": [token]})
    assert [o.request_id for o in processed.outputs] == ["kept"]
    assert pair.processor.num_late_outputs == 1


def test_the_engine_core_sends_each_first_output_and_ending_once():
    requests = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(3)]
    for request in requests:
        request.queue_time_s = 0.25
        request.append_output_token(7, MAX_MODEL_LEN)
    first = client_outputs(0, requests, STATS)
    assert [f.index for f in first.first] == [0, 1, 2] and first.first[0].queue_time_s == 0.25
    assert first.token_offsets is None and first.new_token_ids.tolist() == [7, 7, 7]
    requests[1].append_output_token(8, MAX_MODEL_LEN)  # its last: max_tokens
    second = client_outputs(0, requests[:2], STATS)
    assert not second.first and [f.index for f in second.finished] == [1]
    assert second.new_token_ids.tolist() == [8] and second.token_offsets.tolist() == [0, 0, 1]


# -- untrusted columns ----------------------------------------------------------------


def outputs_bytes(**changes: Any) -> list:
    """A two-request step's outputs, with changes, encoded without the message's own checks."""
    msg: dict[str, Any] = {
        "type": "EngineCoreOutputs",
        "engine_index": 0,
        "request_ids": ["a", "b"],
        "new_token_ids": np.array([5, 6], np.int32),
        "stats": STATS,
    }
    msg.update(changes)
    return Encoder().encode(msg)  # type: ignore[arg-type]


def rows(n: int, width: int = 2) -> dict[str, Any]:
    return {
        "type": "LogprobsLists",
        "logprob_token_ids": np.zeros((n, width), np.int32),
        "logprobs": np.zeros((n, width), np.float32),
        "sampled_token_ranks": np.ones(n, np.int32),
    }


BAD = [
    ({"new_token_ids": np.array([5], np.int32)}, r"1 new_token_ids for 2 request_ids"),
    ({"new_token_ids": np.array([[5, 6]], np.int32)}, r"new_token_ids must be one row"),
    ({"new_token_ids": np.array([5.0, 6.0], np.float32)}, r"one row of integers, got float32"),
    ({"new_token_ids": np.array([5, -1], np.int32)}, r"holds -1"),
    ({"token_offsets": np.array([0, 2], np.int32)}, r"2 token_offsets for 2 request_ids"),
    ({"token_offsets": np.array([0, 1, 3], np.int32)}, r"rise from 0 to 2"),
    ({"token_offsets": np.array([0, 2, 1, 2], np.int32)}, r"3 request_ids|4 token_offsets"),
    (
        {"request_ids": ["a", "b", "c"], "token_offsets": np.array([0, 2, 1, 2], np.int32)},
        r"going down",
    ),
    (  # unsigned, whose differences must not wrap
        {"request_ids": ["a", "b", "c"], "token_offsets": np.array([0, 2, 1, 2], np.uint8)},
        r"going down",
    ),
    ({"request_ids": ["a", "a"]}, r"'a' is in request_ids twice"),
    ({"finished": [{"type": "FinishedOutput", "index": 2, "finish_reason": "stop"}]}, "index 2"),
    (
        {"first": [{"type": "FirstOutput", "index": 1}, {"type": "FirstOutput", "index": 0}]},
        r"first index 0 after 1",
    ),
    (
        {"finished": [{"type": "FinishedOutput", "index": 0, "finish_reason": "abort"}]},
        r"finish_reason",
    ),
    ({"logprobs": [{"type": "RequestLogprobs", "index": 1, "rows": rows(2)}]}, r"2 rows .* 1 new"),
    (
        {
            "logprobs": [
                {
                    "type": "RequestLogprobs",
                    "index": 0,
                    "rows": {**rows(1), "logprobs": np.zeros((1, 3), np.float32)},
                }
            ]
        },
        r"logprobs of 'a'.* do not make rows",
    ),
]


@pytest.mark.parametrize(("changes", "problem"), BAD)
def test_outputs_whose_columns_disagree_do_not_decode(changes, problem):
    with pytest.raises(ProtocolError, match=problem):
        Decoder().decode(outputs_bytes(**changes))


def test_good_columns_decode():
    msg = Decoder().decode(
        outputs_bytes(
            token_offsets=np.array([0, 0, 2], np.int32),
            logprobs=[{"type": "RequestLogprobs", "index": 1, "rows": rows(2)}],
        )
    )
    assert isinstance(msg, EngineCoreOutputs) and msg.logprobs[0].rows.logprobs.shape == (2, 2)
