"""What vLLM's clients send, over the server test_serve.py shares (two API servers): the
loglikelihood requests of lm-eval-harness (echo with logprobs, echo with max_tokens 0),
requests without a model, vLLM's own fields at the values its clients send (taken, or
refused by name at others), stream_options as vLLM reads them, /tokenize of a
conversation with the chat options, and the bounds vLLM sets (temperature, logprobs
without top_logprobs, prompt_logprobs 0 streamed, request_id). The file sorts before
test_serve_sampling.py, whose last test stops the shared server."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.test_serve import MODEL

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(two_api_servers):
    return two_api_servers


def post(server, path: str, body: dict, **headers: str) -> tuple[int, Any, dict[str, str]]:
    """(status, the JSON answer or a stream's events, the response's headers)."""
    request = urllib.request.Request(
        server.base + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw, got = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read().decode(), exc.headers
    got = {k.lower(): v for k, v in got.items()}
    if not body.get("stream") or status != 200:
        return status, json.loads(raw), got
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return status, [json.loads(e) for e in events[:-1]], got


def prompt_tokens(server, **body: Any) -> list[int]:
    status, answer, _ = post(server, "/tokenize", body)
    assert status == 200, answer
    return answer["tokens"]


def test_lm_eval_loglikelihood_payload(server):
    """lm-eval-harness's local-completions: the prompt's tokens with their logprobs, the
    first null, then the one generated token (echo with logprobs was a 400)."""
    ids = prompt_tokens(server, prompt=PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}  # fmt: skip
    status, answer, _ = post(server, COMPLETIONS, body)
    assert status == 200, answer
    [choice] = answer["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 == answer["usage"]["prompt_tokens"] + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(value <= 0 for value in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == choice["text"] and choice["text"].startswith(PROMPT)
    # The prompt's positions are its prompt_logprobs, each top entry its token and 1 more.
    for p, (token, value, top) in enumerate(zip(*(logprobs[k][1:-1] for k in (
            "tokens", "token_logprobs", "top_logprobs")), strict=True), 1):  # fmt: skip
        assert choice["prompt_logprobs"][p][str(ids[p])]["logprob"] == value
        assert top[token] == value and 1 <= len(top) <= 2
    offsets = logprobs["text_offset"]
    assert offsets == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids) + 1)]
    # As lm-eval sends it: token ids, several prompts, a seed; one choice each, in order.
    batch = {**body, "prompt": [ids, ids[:3]], "seed": 1234}
    status, answer, _ = post(server, COMPLETIONS, batch)
    assert status == 200 and [len(c["logprobs"]["tokens"]) for c in answer["choices"]] == [
        len(ids) + 1, 4,
    ]  # fmt: skip
    again = answer["choices"][0]["logprobs"]["token_logprobs"]  # batched: within rounding
    assert again[0] is None and again[1:] == pytest.approx(logprobs["token_logprobs"][1:], abs=1e-3)
    # Streamed: the prompt's positions come with the first chunk.
    status, chunks, _ = post(server, COMPLETIONS, {**body, "stream": True})
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert status == 200 and streamed == logprobs["tokens"]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server):
    ids = prompt_tokens(server, prompt=PROMPT)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    status, answer, _ = post(server, COMPLETIONS, body)
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["text"] == PROMPT and len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert answer["usage"]["completion_tokens"] == 0  # no generated token returned
    status, answer, _ = post(server, COMPLETIONS, {"prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert (status, answer["choices"][0]["text"]) == (200, PROMPT)
    status, answer, _ = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 0})
    assert (status, answer["error"]["param"]) == (400, "max_tokens")  # vLLM's too


def test_model_may_be_left_out(server):
    """vLLM's: the served model (it was a 400 naming model)."""
    status, answer, _ = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 1})
    assert status == 200 and answer["model"] == MODEL
    status, answer, _ = post(server, CHAT_COMPLETIONS, {"messages": CHAT, "max_tokens": 1})
    assert status == 200 and answer["model"] == MODEL
    status, answer, _ = post(server, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and answer["count"] == 5
    status, answer, _ = post(server, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and answer["prompt"] == PROMPT


# vLLM's fields at the values its clients send when they ask for nothing (its defaults),
# each was "Unrecognized request argument"; and a value each refuses, naming it.
BOTH = [
    ("spaces_between_special_tokens", True, False),  # with skip_special_tokens false
    ("return_token_ids", False, True),
    ("request_id", "run-1", "two words"),
    ("guided_decoding_backend", "xgrammar", "outlines"),
    ("guided_whitespace_pattern", None, " "),
]
STRUCTURED = [
    ("disable_any_whitespace", False, None),
    ("disable_additional_properties", False, None),
    ("disable_fallback", False, None),
    ("whitespace_pattern", None, " "),
]
CHAT_ONLY = [
    ("echo", False, True),
    ("best_of", 1, 2),
    ("include_reasoning", True, None),
    ("mm_processor_kwargs", {}, {"size": 1}),
    ("add_special_tokens", False, None),
]
NEUTRAL = [
    *[(path, {name: value}) for name, value, _ in BOTH for path in (COMPLETIONS, CHAT_COMPLETIONS)],
    (COMPLETIONS, {"add_special_tokens": True}),
    *[(COMPLETIONS, {"structured_outputs": {"choice": [" Paris", " Lyon"], name: value}})
      for name, value, _ in STRUCTURED],
    *[(CHAT_COMPLETIONS, {name: value}) for name, value, _ in CHAT_ONLY],
    *[(CHAT_COMPLETIONS, {"messages": [*CHAT, {"role": "assistant", "content": "Paris.",
                                                 field: None}, *CHAT]})
      for field in ("reasoning_content", "reasoning")],
    (CHAT_COMPLETIONS, {"messages": [*CHAT, {"role": "assistant", "content": "Paris.",
                                             "reasoning_content": "Easy."}, *CHAT]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields"), NEUTRAL, ids=lambda v: json.dumps(v)[:50])
def test_vllm_s_fields_at_their_defaults_are_taken(server, path, fields):
    base = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": CHAT}
    status, answer, _ = post(server, path, {**base, "max_tokens": 1, **fields})
    assert status == 200, answer


REFUSED = [
    *[(path, {name: value}, name) for name, _, value in BOTH
      for path in (COMPLETIONS, CHAT_COMPLETIONS) if name != "spaces_between_special_tokens"],
    (COMPLETIONS, {"spaces_between_special_tokens": False, "skip_special_tokens": False},
     "spaces_between_special_tokens"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    *[(CHAT_COMPLETIONS, {name: value}, name) for name, _, value in CHAT_ONLY
      if value is not None],
    (CHAT_COMPLETIONS, {"messages": [{**CHAT[0], "reasoning": "Hm."}]}, "messages[0].reasoning"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED, ids=lambda v: str(v)[:40])
def test_vllm_s_fields_asking_for_what_is_not_served_are_refused_by_name(
    server, path, fields, param
):
    base = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": CHAT}
    status, answer, _ = post(server, path, {**base, "max_tokens": 1, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_an_assistant_s_reasoning_is_taken_where_the_template_ignores_it(server):
    """SmolLM2's template writes no reasoning, so the prompt is the same (vLLM's: the
    template gets it as reasoning and reasoning_content)."""
    reply = {"role": "assistant", "content": "Paris."}
    plain = prompt_tokens(server, messages=[*CHAT, reply, *CHAT])
    thought = prompt_tokens(server, messages=[*CHAT, {**reply, "reasoning": "Easy."}, *CHAT])
    assert thought == plain


def test_stream_options_as_vllm_reads_them(server):
    def usages(options: dict | None, path: str = COMPLETIONS) -> list[dict | None]:
        base = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": CHAT}
        body = {**base, "max_tokens": 2, "stream": True, "stream_options": options}
        status, chunks, _ = post(server, path, body)
        assert status == 200, chunks
        return [c.get("usage") for c in chunks]

    # {} and null ask for no usage (vLLM's and OpenAI's; both were a 400 or sent none).
    for options in ({}, {"include_usage": None}, {"continuous_usage_stats": False}):
        assert not any(usages(options))
    *each, last = usages({"include_usage": True, "continuous_usage_stats": True})
    assert [u["completion_tokens"] for u in each] == [1, 2] and last["total_tokens"] == 7
    *each, last = usages({"include_usage": True, "continuous_usage_stats": True}, CHAT_COMPLETIONS)
    assert [u["completion_tokens"] for u in each] == [0, 1, 2, 2]  # role, 2 tokens, the end
    assert last["completion_tokens"] == 2 and "prompt_tokens_details" in last
    assert usages({"include_usage": True})[:-1] == [None, None]


def test_tokenize_takes_the_chat_options_and_counts_what_chat_prompts(server):
    """chat_template_kwargs, continue_final_message, return_token_strs were a 400."""
    messages = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    options = {"continue_final_message": True, "add_generation_prompt": False,
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    status, answer, _ = post(
        server, "/tokenize", {"messages": messages, **options, "return_token_strs": True}
    )
    assert status == 200, answer
    assert len(answer["token_strs"]) == answer["count"] and answer["token_strs"][-1] == "Ġis"
    status, reply, _ = post(
        server, CHAT_COMPLETIONS, {"messages": messages, **options, "max_tokens": 1}
    )
    assert status == 200 and reply["usage"]["prompt_tokens"] == answer["count"]
    status, fresh, _ = post(server, "/tokenize", {"messages": messages})
    assert status == 200 and fresh["count"] != answer["count"] and fresh["token_strs"] is None
    status, bad, _ = post(server, "/tokenize", {"prompt": PROMPT, "continue_final_message": True})
    assert (status, bad["error"]["param"]) == (400, "continue_final_message")


def test_bounds_as_vllm_s(server):
    """temperature above 2, top_logprobs 0 without logprobs and prompt_logprobs 0 streamed
    were 400s; tools [] with "required" stays one (vLLM refuses tools [] itself)."""
    chat = {"messages": CHAT, "max_tokens": 1}
    status, answer, _ = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 1,
                                                   "temperature": 2.5})  # fmt: skip
    assert status == 200, answer
    status, answer, _ = post(server, CHAT_COMPLETIONS, {**chat, "logprobs": False,
                                                        "top_logprobs": 0})  # fmt: skip
    assert status == 200 and answer["choices"][0]["logprobs"] is None
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "stream": True}
    assert post(server, COMPLETIONS, body)[0] == 200
    status, answer, _ = post(server, CHAT_COMPLETIONS, {**chat, "tools": [],
                                                        "tool_choice": "required"})  # fmt: skip
    assert (status, answer["error"]["param"]) == (400, "tool_choice")


def test_a_body_s_request_id_names_the_response_unless_the_header_does(server):
    body = {"prompt": PROMPT, "max_tokens": 1, "request_id": "lm-eval-7"}
    status, answer, headers = post(server, COMPLETIONS, body)
    assert (status, answer["id"], headers["x-request-id"]) == (200, "cmpl-lm-eval-7", "lm-eval-7")
    status, answer, headers = post(server, COMPLETIONS, body, **{"X-Request-Id": "hdr-1"})
    assert (answer["id"], headers["x-request-id"]) == ("cmpl-hdr-1", "hdr-1")
    chat = {"messages": CHAT, "max_tokens": 1, "request_id": "c-2", "stream": True}
    status, chunks, _ = post(server, CHAT_COMPLETIONS, chat)
    assert {c["id"] for c in chunks} == {"chatcmpl-c-2"}


def test_allowed_token_ids_limit_what_completions_and_chat_sample(server):
    """vLLM's allowed_token_ids (was a 400): greedy takes the likeliest allowed token (not
    " Paris"), n=2 seeded samples draw only allowed ones, logit_bias picks among them,
    and chat streams under them too; ids outside the vocabulary are a 400 naming them."""
    ids = prompt_tokens(server, prompt=" Rome Berlin Madrid", add_special_tokens=False)
    assert len(ids) == 3
    words = r"^(?:(?: Rome)|(?: Berlin)|(?: Madrid))+$"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "allowed_token_ids": ids,
            "ignore_eos": True}  # fmt: skip
    status, greedy, _ = post(server, COMPLETIONS, body)
    assert status == 200 and re.match(words, greedy["choices"][0]["text"]), greedy
    sampled = {**body, "temperature": 1.0, "seed": 3, "n": 2}
    status, answer, _ = post(server, COMPLETIONS, sampled)
    assert status == 200 and all(re.match(words, c["text"]) for c in answer["choices"]), answer
    status, biased, _ = post(server, COMPLETIONS, {**body, "logit_bias": {str(ids[2]): 100}})
    assert status == 200 and biased["choices"][0]["text"] == " Madrid" * 4, biased
    # With a grammar: the intersection (EOS, 2, allowed to end the choice).
    choice = {"prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": [ids[1], 2],
              "structured_outputs": {"choice": [" Rome", " Berlin"]}}  # fmt: skip
    status, answer, _ = post(server, COMPLETIONS, choice)
    assert status == 200 and answer["choices"][0]["text"] == " Berlin", answer
    chat = {"messages": CHAT, "max_tokens": 3, "allowed_token_ids": ids, "stream": True,
            "ignore_eos": True}  # fmt: skip
    status, chunks, _ = post(server, CHAT_COMPLETIONS, chat)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert status == 200 and re.match(words, text), chunks
    status, answer, _ = post(server, CHAT_COMPLETIONS, {**chat, "allowed_token_ids": [5, 49152]})
    assert status == 400 and answer["error"]["param"] == "allowed_token_ids"
    assert answer["error"]["message"] == (
        "allowed_token_ids: token id 49152 is outside the vocabulary [0, 49152)"
    )
