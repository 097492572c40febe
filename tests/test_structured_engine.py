"""The engine side of structured outputs without workers: grammars compiled once per
constraint in a thread, requests that wait for theirs and fail with its error, aborts
while compiling, matchers that advance with each token and end the request with "stop",
and the bitmask of a step's requests."""

from __future__ import annotations

import threading
from concurrent.futures import Future

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
    output, refused = structured.fill([req], slot=0).result()
    assert output is not None and output.req_handles.tolist() == [5] and not refused
    allowed = np.flatnonzero(
        np.unpackbits(output.grammar_bitmask.view(np.uint8), bitorder="little")[:VOCAB]
    )
    compiled = structured.compiler.compile(req.sampling_params.structured_outputs).result()
    vocab = compiled.tokenizer_info.decoded_vocab
    assert {vocab[t] for t in allowed} >= {b"yes", b"no"} and EOS not in allowed
    token = next(t for t in allowed if vocab[t] == b"yes")
    done = Request("m2", [1, 2, 3], req.sampling_params, eos_token_ids=[EOS])
    done.grammar = RequestGrammar(compiled, [EOS], num_accepted=3)
    assert not done.append_output_token(int(token), 100)
    assert done.grammar.num_accepted == 3  # "yes" waits for the next bitmask
    assert done.append_output_token(EOS, 100) and done.finish_reason is FinishReason.STOP
    assert done.grammar.num_accepted == 5 and done.grammar.terminated
    done.handle = 6
    assert structured.fill([done], slot=0).result().output is None  # finished: nothing left


def replayed(structured: StructuredOutputs, request: Request):
    """A matcher of request's own, fed its output tokens one by one (the per-request
    advance the engine's batches must agree with)."""
    import xgrammar as xgr

    compiled = structured.compiler.compile(request.sampling_params.structured_outputs).result()
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=request.eos_token_list)
    for token in request.output_token_ids:
        assert matcher.accept_token(token), f"{request.req_id}: token {token} breaks it"
    return matcher


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batched_matchers_agree_with_their_own_through_ends_and_preemption(async_scheduling):
    """Requests with grammars that end early (choice, regex), that outlast max_tokens
    (json) and without, in a KV cache that preempts some: every bitmask the engine fills
    in batches equals the one a matcher of each request's own gives after its tokens,
    and each grammar request ends by its grammar or by length, as its matcher says."""
    from bench.end_to_end import LONG_SCHEMA
    from bench.engine_step_structured import GrammarExecutor
    from zmqworker.engine.core import EngineCore

    require_embedded_model()
    structured = StructuredOutputs(GrammarCompiler(str(default_model_path(progress=False)), VOCAB))
    executor = GrammarExecutor(num_blocks=12)  # blocks of 16: 6 requests need up to 36
    core = EngineCore(executor, 128, async_scheduling=async_scheduling, structured=structured)
    kinds = [
        {"choice": ["yes", "no"]},
        {"regex": "[a-z]{30}"},
        {"json": LONG_SCHEMA},
        {"regex": "[a-z ]{12}"},
        None,
        None,
    ]
    requests = []
    for i, kind in enumerate(kinds):
        constraint = StructuredOutputsParams(**kind) if kind else None
        if constraint is not None:  # compiled before: they all start at once
            structured.compiler.compile(constraint).result()
        params = SamplingParams(max_tokens=60, structured_outputs=constraint)
        requests.append(Request(f"r{i}", list(range(10 + i, 40 + i)), params, eos_token_ids=[0]))
        core.add_request(requests[-1])
    fill, compared = structured.fill, []

    def checked_fill(step_requests, slot):
        future = fill(step_requests, slot)
        output, refused = future.result()
        assert not refused
        live = [r for r in step_requests if not r.is_finished]
        expected = np.zeros((len(live), VOCAB // 32), np.int32)
        for row, request in enumerate(live):
            replayed(structured, request).fill_next_token_bitmask(expected, row)
            compared.append(request.req_id)
        np.testing.assert_array_equal(output.req_handles, [r.handle for r in live])
        np.testing.assert_array_equal(output.grammar_bitmask, expected)
        return future

    structured.fill = checked_fill
    try:
        while core.has_work():
            core.step()
    finally:
        core.shutdown()
    assert core.scheduler.num_preemptions > 0, "the KV cache was meant to preempt some"
    assert {"r0", "r1", "r2", "r3"} <= set(compared)
    reasons = [r.finish_reason for r in requests]
    assert reasons[:4] == [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH] + [
        FinishReason.STOP
    ]
    for request in requests[:4]:
        ended = request.finish_reason is FinishReason.STOP
        assert (request.output_token_ids[-1] == 0) == ended  # EOS: the grammar's end
        assert replayed(structured, request).is_terminated() == ended
        assert request.grammar is not None and request.grammar.terminated == ended
        if ended:  # the engine's matcher took every token, EOS last
            assert request.grammar.num_accepted == request.num_tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_token_the_grammar_refuses_fails_its_request_alone(async_scheduling):
    """Workers that ignore the bitmask (as a request's bad_words that ban every token its
    grammar allows make them): the fill finds the token its matcher refuses, and that
    request alone is aborted, with why; a plain request beside it runs to its end."""
    from bench.engine_step_structured import GrammarExecutor
    from zmqworker.engine.core import EngineCore

    class Ignoring(GrammarExecutor):
        def sample_tokens(self, grammar, non_block=False):
            return super().sample_tokens(None, non_block)  # tokens that are not "x"

    require_embedded_model()
    structured = StructuredOutputs(GrammarCompiler(str(default_model_path(progress=False)), VOCAB))
    core = EngineCore(Ignoring(16), 128, async_scheduling=async_scheduling, structured=structured)
    constraint = StructuredOutputsParams(regex="x{20}")
    structured.compiler.compile(constraint).result()
    params = SamplingParams(max_tokens=20, structured_outputs=constraint)
    doomed = Request("doomed", list(range(10, 30)), params, eos_token_ids=[0])
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_ids=[0])
    core.add_request(plain)
    core.add_request(doomed)
    changed = []
    try:
        while core.has_work():
            changed += core.step()
    finally:
        core.shutdown()
    assert doomed.finish_reason is FinishReason.ABORT and doomed in changed
    assert doomed.error is not None and "'doomed': token" in doomed.error
    assert plain.finish_reason is FinishReason.LENGTH and len(plain.output_token_ids) == 8


def test_a_refused_stop_token_aborts_its_request(structured):
    """EOS where the grammar has not ended (taken at once, as it may end the request)."""
    req = request("eos", choice=["yes", "no"])
    structured.add(req)
    ready(structured, 1)
    assert req.append_output_token(EOS, 100) and req.finish_reason is FinishReason.ABORT
    assert req.error is not None and "breaks its structured_outputs" in req.error


def test_a_choice_beyond_the_basic_plane_is_itself():
    import xgrammar as xgr

    from zmqworker.engine.grammars import parse_grammar

    choices = ["\U0001f600 ok", 'say "hi"', "back\\slash", "tab\tnew\nline"]
    grammar = parse_grammar(StructuredOutputsParams(choice=choices))
    for choice in choices:
        assert xgr.testing._is_grammar_accept_string(grammar, choice), choice
    assert not xgr.testing._is_grammar_accept_string(grammar, "\U0001f600")


def test_a_fill_in_shares_agrees_with_each_matcher_and_names_a_refused_token(structured):
    """40 requests (two shares of rows, on a machine of two cores or more), each lacking
    0 to 2 tokens: every row is the one the request's own matcher gives; a refused token
    names its request."""
    constraint = {"regex": "[a-z]{60}"}
    requests = [request(f"s{i}", **constraint) for i in range(40)]
    for r in requests:
        structured.add(r)
    ready(structured, 40)
    compiled = structured.compiler.compile(requests[0].sampling_params.structured_outputs)
    vocab = compiled.result().tokenizer_info.decoded_vocab
    words = [vocab.index(w) for w in (b"the", b"a", b"ing")]
    for i, r in enumerate(requests):
        r.handle = i
        r.all_token_ids += words[: i % 3]
    output = structured.fill(requests, slot=0).result().output
    expected = np.zeros((40, VOCAB // 32), np.int32)
    for i, r in enumerate(requests):
        replayed(structured, r).fill_next_token_bitmask(expected, i)
    np.testing.assert_array_equal(output.grammar_bitmask, expected)
    assert [r.grammar.num_accepted for r in requests] == [r.num_tokens for r in requests]
    requests[37].all_token_ids.append(vocab.index(b"1"))
    output, refused = structured.fill(requests, slot=1).result()
    assert list(refused) == ["s37"] and "'s37': token" in refused["s37"]
    assert output is not None and 37 not in output.req_handles.tolist()
    assert len(output.grammar_bitmask) == 39


class _Strict:
    """A GrammarExecutor mixin: a forward must be sampled before the next step (the
    workers' rule), and the first send of sample_tokens fails as to a dead rank."""

    sends_to_fail = 1

    def execute_model(self, so, sample=True, non_block=False):
        assert self._pending is None, "execute_model before sample_tokens consumed the step"
        return super().execute_model(so, sample, non_block)

    def sample_tokens(self, grammar, non_block=False):
        if self.sends_to_fail:
            self.sends_to_fail -= 1
            raise RuntimeError("rank 1 died")
        return super().sample_tokens(grammar, non_block)


def _step_within(core, seconds: float = 30.0) -> BaseException | None:
    """core.step()'s exception (None if it returned); the test fails if it hangs."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            core.step()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"step() still running after {seconds:g} s"
    return outcome[0]


def test_a_failure_between_a_grammar_step_s_forward_and_its_sample_is_recovered_from():
    """sample_tokens failing as it went out left the step at the head of the batch queue
    with no sample: the recovery waited on it for ever. Now the step gets its
    sample_tokens (no bitmask) once that can go out, so the workers take steps again,
    and every request of the failed step's time is aborted, those compiling too."""
    from bench.engine_step_structured import GrammarExecutor
    from zmqworker.engine.core import EngineCore

    class Strict(_Strict, GrammarExecutor):
        pass

    require_embedded_model()
    structured = StructuredOutputs(GrammarCompiler(str(default_model_path(progress=False)), VOCAB))
    core = EngineCore(Strict(16), 128, structured=structured)
    constraint = StructuredOutputsParams(regex="x{5}")
    structured.compiler.compile(constraint).result()
    params = SamplingParams(max_tokens=5, structured_outputs=constraint)
    first = Request("first", [1, 2, 3], params, eos_token_ids=[0])
    core.add_request(first)
    never = Future()  # a grammar still compiling when the step fails
    compile_ = structured.compiler.compile
    structured.compiler.compile = lambda p: never if p.regex == "y" else compile_(p)
    compiling = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="y"))
    waiting = Request("waiting", [1, 2, 3], compiling, eos_token_ids=[0])
    core.add_request(waiting)
    with pytest.raises(ValueError, match="'waiting' is already waiting for its grammar"):
        core.add_request(Request("waiting", [4], SamplingParams(max_tokens=2)))  # no grammar
    try:
        error = _step_within(core)
        assert isinstance(error, RuntimeError) and "rank 1 died" in str(error)
        assert first.finish_reason is FinishReason.ABORT
        assert waiting.finish_reason is FinishReason.ABORT and len(structured) == 0
        again = Request("again", [1, 2, 3], params, eos_token_ids=[0])
        core.add_request(again)
        while core.has_work():
            assert _step_within(core) is None
        assert again.finish_reason is FinishReason.STOP and again.grammar.terminated
    finally:
        core.shutdown()
