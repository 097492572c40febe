"""The engine side of structured outputs without workers: grammars compiled once per
constraint in a thread, requests that wait for theirs and fail with its error, aborts
while compiling, matchers that advance with each token and end the request with "stop",
and the bitmask of a step's requests."""

from __future__ import annotations

import numpy as np
import pytest

from messages import SamplingParams, StructuredOutputsParams
from tests.test_readme import require_embedded_model
from zmqworker.engine.grammar_compiler import GrammarCompiler
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.request_grammar import RequestGrammar
from zmqworker.engine.structured_outputs import StructuredOutputs
from zmqworker.models.embedded import default_model_path

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def structured():
    require_embedded_model()
    manager = StructuredOutputs(GrammarCompiler(str(default_model_path(progress=False)), VOCAB))
    yield manager
    manager.shutdown()


def request(req_id: str, **kind) -> Request:
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(**kind))
    return Request(req_id, [1, 2, 3], params, eos_token_ids=[EOS])


def ready(manager: StructuredOutputs, n: int) -> tuple[list[Request], list]:
    got, failed = [], []
    for _ in range(2000):
        more, bad = manager.take_ready(timeout=0.05)
        got, failed = got + more, failed + bad
        if len(got) + len(failed) == n:
            return got, failed
    raise AssertionError("grammars not ready after 100 s")


def test_a_constraint_compiles_once_and_requests_wait_for_it(structured):
    a, b = request("a", choice=["yes", "no"]), request("b", choice=["yes", "no"])
    structured.add(a)
    structured.add(b)
    assert structured.compiler.compile(a.sampling_params.structured_outputs) is (
        structured.compiler.compile(b.sampling_params.structured_outputs)
    )
    got, failed = ready(structured, 2)
    assert [r.req_id for r in got] == ["a", "b"] and not failed and len(structured) == 0


def test_an_abort_while_compiling_and_a_grammar_that_fails(structured):
    doomed = request("doomed", regex="[0-9]{3}")
    structured.add(doomed)
    assert structured.abort("doomed") is doomed and structured.abort("doomed") is None
    structured.add(request("bad", regex="a(b"))  # the front end refuses it; here it fails
    got, failed = ready(structured, 1)
    assert not got and failed[0][0].req_id == "bad" and "regex is invalid" in failed[0][1]


def test_the_matcher_advances_masks_and_ends_the_request(structured):
    req = request("m", choice=["yes", "no"])
    structured.add(req)
    ready(structured, 1)
    req.handle = 5
    output = structured.grammar_output([req])
    assert output is not None and output.req_handles.tolist() == [5]
    allowed = np.flatnonzero(
        np.unpackbits(output.grammar_bitmask.view(np.uint8), bitorder="little")[:VOCAB]
    )
    compiled = structured.compiler.compile(req.sampling_params.structured_outputs).result()
    vocab = compiled.tokenizer_info.decoded_vocab
    assert {vocab[t] for t in allowed} >= {b"yes", b"no"} and EOS not in allowed
    with pytest.raises(RuntimeError, match="breaks its structured_outputs constraint"):
        req.append_output_token(EOS, 100)
    token = next(t for t in allowed if vocab[t] == b"yes")
    done = Request("m2", [1, 2, 3], req.sampling_params, eos_token_ids=[EOS])
    done.grammar = RequestGrammar(compiled, [EOS])
    assert not done.append_output_token(int(token), 100)
    assert done.append_output_token(EOS, 100) and done.finish_reason is FinishReason.STOP
    done.handle = 6
    assert structured.grammar_output([done]) is None  # finished: nothing to constrain
