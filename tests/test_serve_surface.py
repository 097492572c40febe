"""zmqworker serve's surface beyond generation, over a real server: /tokenize and
/detokenize (vLLM's shapes), prompt_logprobs against transformers, the X-Request-Id
header, CORS (--allowed-origins and its companions; without them no CORS headers,
checked in test_serve_bad_input.py), and Llama 3's JSON tool calls read by the
llama3_json parser (its Hermes counterpart: test_serve_tools.py)."""

from __future__ import annotations

import functools
import http.client
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from tests.test_serve import MODEL, Server
from zmqworker.cli import build_parser
from zmqworker.cli import serve as serve_cli
from zmqworker.models import embedded

APP = "http://app.example"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--allowed-origins", APP, "--allow-credentials",
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
    )  # fmt: skip
    yield srv
    srv.stop()


def call(
    server: Server, method: str, path: str, body: dict | None = None, **headers: str
) -> tuple[int, dict[str, str], dict | None]:
    """(status, headers with lowercase names, decoded JSON body or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {k.replace("_", "-"): v for k, v in headers.items()}
        conn.request(method, path, data, {"Content-Type": "application/json", **sent})
        response = conn.getresponse()
        raw = response.read()
        got = {k.lower(): v for k, v in response.getheaders()}
        is_json = got.get("content-type", "").startswith("application/json")
        return response.status, got, json.loads(raw) if is_json else None
    finally:
        conn.close()


def test_tokenize_and_detokenize_a_prompt_and_a_conversation(server):
    status, _, answer = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and answer["max_model_len"] == 512
    assert answer["count"] == len(answer["tokens"]) == 5  # as the completion counts it
    status, _, text = call(
        server, "POST", "/detokenize", {"model": MODEL, "tokens": answer["tokens"]}
    )
    assert status == 200 and text == {"prompt": PROMPT}

    def chat_tokens(**options) -> list[int]:
        status, _, answer = call(
            server, "POST", "/tokenize", {"model": MODEL, "messages": CHAT, **options}
        )
        assert status == 200, answer
        return answer["tokens"]

    prompt, history = chat_tokens(), chat_tokens(add_generation_prompt=False)
    assert len(prompt) > len(history) and prompt[: len(history)] == history
    reply = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert reply.usage.prompt_tokens == len(prompt)  # what generation is given
    bos = chat_tokens(add_special_tokens=True)
    assert len(bos) >= len(prompt) and bos[-len(prompt) :] == prompt
    _, _, text = call(server, "POST", "/detokenize", {"model": MODEL, "tokens": prompt})
    assert text["prompt"].startswith("<|im_start|>") and CHAT[0]["content"] in text["prompt"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/tokenize", {"model": "other", "prompt": "Hi"}, 404, "model", "The model `other`"),
        ("/tokenize", {"model": MODEL}, 400, "prompt", "give either prompt or messages"),
        (
            "/tokenize",
            {"model": MODEL, "prompt": "Hi", "add_generation_prompt": True},
            400,
            "add_generation_prompt",
            "add_generation_prompt applies to messages",
        ),
        ("/tokenize", {"model": MODEL, "prompt": "Hi", "tools": []}, 400, "tools", "tools applies"),
        (
            "/tokenize",
            {"model": MODEL, "messages": CHAT, "tools": [{"type": "x", "function": {"name": "f"}}]},
            400,
            "tools[0].type",
            'tools[0].type must be "function"',
        ),
        (
            "/tokenize",
            {"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]},
            400,
            "messages[0].role",
            "messages[0].role must be one of",
        ),
        ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, 400, "tokens[1]", "tokens[1]: must"),
        ("/detokenize", {"model": MODEL, "tokens": "Hi"}, 400, "tokens", "tokens: expected an"),
    ],
)
def test_bad_tokenize_requests_name_the_field(server, path, body, status, param, message):
    got, _, answer = call(server, "POST", path, body)
    assert got == status, answer
    assert answer["error"]["param"] == param and answer["error"]["message"].startswith(message)


def test_the_request_id_names_the_response_and_is_echoed(server):
    client = server.client(max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "run-7/a"}
    )
    assert raw.headers["x-request-id"] == "run-7/a" and raw.parse().id == "cmpl-run-7/a"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, stream=True,
            extra_headers={"X-Request-Id": "chat-1"},
        )
    )  # fmt: skip
    assert {chunk.id for chunk in chunks} == {"chatcmpl-chat-1"}
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    made = raw.headers["x-request-id"]
    assert len(made) == 32 and raw.parse().id == f"cmpl-{made}"
    _, headers, _ = call(server, "POST", "/v1/completions", {"model": "other", "prompt": "x"})
    assert len(headers["x-request-id"]) == 32  # errors carry one too


@pytest.mark.parametrize("value", ["a" * 129, "two words", "caf\xe9"])
def test_a_hostile_request_id_is_refused(server, value):
    status, headers, answer = call(server, "GET", "/v1/models", X_Request_Id=value)
    assert status == 400 and answer["error"]["param"] == "X-Request-Id"
    assert answer["error"]["message"].startswith("the X-Request-Id header must be given once")
    assert "x-request-id" not in headers


def test_cors_lets_the_allowed_origin_in_and_no_other(server):
    status, headers, _ = call(
        server, "OPTIONS", "/v1/chat/completions", Origin=APP,
        Access_Control_Request_Method="POST", Access_Control_Request_Headers="authorization",
    )  # fmt: skip
    assert status == 200 and headers["access-control-allow-origin"] == APP
    assert headers["access-control-allow-credentials"] == "true"
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = call(
        server, "OPTIONS", "/v1/chat/completions", Origin="http://evil.example",
        Access_Control_Request_Method="POST",
    )  # fmt: skip
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = call(server, "GET", "/v1/models", Origin=APP)
    assert status == 200 and headers["access-control-allow-origin"] == APP
    assert headers["access-control-expose-headers"].lower() == "x-request-id"
    _, headers, _ = call(server, "GET", "/v1/models", Origin="http://evil.example")
    assert "access-control-allow-origin" not in headers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--allowed-methods", "GET"], "--allowed-methods needs --allowed-origins"),
        (["--allow-credentials"], "--allow-credentials needs --allowed-origins"),
        (["--allowed-origins", "http://a.example/"], "'http://a.example/' is not an origin"),
        (["--allowed-origins", '["http://a.example"]'], "is not an origin"),
        (["--allowed-origins", "*", "--allowed-headers", "a b"], "--allowed-headers: 'a b'"),
    ],
)
def test_cors_options_are_checked_before_anything_starts(argv, message):
    parser, _ = build_parser()
    with pytest.raises(ValueError, match=message):
        serve_cli.run(parser.parse_args(["serve", *argv]))


@functools.cache
def hf_log_softmax(token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' log_softmax of the embedded model: row j predicts token j + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded.default_model_path())
    with torch.no_grad():
        return torch.log_softmax(model.eval()(torch.tensor([list(token_ids)])).logits[0], -1)


def test_prompt_logprobs_of_a_completion_and_a_chat_equal_transformers(server):
    client = server.client(max_retries=0)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    positions = out.choices[0].model_extra["prompt_logprobs"]
    _, _, tokenized = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})
    ids = tokenized["tokens"]
    assert len(positions) == len(ids) and positions[0] is None
    reference = hf_log_softmax(tuple(ids))
    for p, entry in enumerate(positions[1:], 1):
        row = reference[p - 1]
        top = row.topk(2).indices.tolist()
        assert list(entry) == [str(t) for t in dict.fromkeys([ids[p], *top])]
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - row[ids[p]].item()) < 1e-3
        assert mine["rank"] == int((row > row[ids[p]]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in top if t != ids[p]] == [
            r for r, t in enumerate(top, 1) if t != ids[p]
        ]
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    positions = chat.model_extra["prompt_logprobs"]
    assert len(positions) == chat.usage.prompt_tokens and positions[0] is None
    assert all(len(p) == 1 and next(iter(p.values()))["decoded_token"] for p in positions[1:])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs=-1 \(the whole vocabulary"),
        ({"prompt_logprobs": 21}, "prompt_logprobs=21 is more than max_logprobs=20"),
    ],
)
def test_prompt_logprobs_beyond_what_is_served_are_refused_by_name(server, extra, message):
    status, _, answer = call(
        server, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **extra}
    )
    assert status == 400 and answer["error"]["param"] == "prompt_logprobs", answer
    assert re.search(message, answer["error"]["message"]), answer


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
# The embedded model is too small to choose a call: a regex makes it write one, in Llama
# 3's JSON format (a call is the whole reply), with a city it picks.
LLAMA3_CALL = (
    r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,5}", "unit": "celsius"\}\}'
)


def test_llama3_json_reads_an_auto_tool_call_whole_and_streamed(server):
    client = server.client(max_retries=0)
    args = {
        "model": MODEL, "messages": CHAT, "max_tokens": 100, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "extra_body": {"structured_outputs": {"regex": LLAMA3_CALL}},
    }  # fmt: skip
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] == "celsius" and re.fullmatch("[A-Z][a-z]{2,5}", arguments["city"])
    name, streamed, reason = None, "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for entry in delta.tool_calls or []:
            name = entry.function.name or name
            streamed += entry.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert (name, reason) == ("get_weather", "tool_calls")
    assert json.loads(streamed) == arguments  # greedy: the same call


# A JSON reply with a "name" (as response_format json_object gives), forced by a regex.
NO_CALL = r'\{"name": "John", "age": 25\}'


def test_a_json_reply_that_calls_no_tool_is_content_whole_and_streamed(server):
    """It came back as tool_calls [{"name": "John", "arguments": "{}"}], streamed too (a
    function the request's tools do not hold: tests/test_tool_parsers.py)."""
    regex = NO_CALL
    client = server.client(max_retries=0)
    args = {
        "model": MODEL, "messages": CHAT, "max_tokens": 40, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": regex}},
    }  # fmt: skip
    choice = client.chat.completions.create(**args).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert re.fullmatch(regex, choice.message.content)
    content, reason = "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        assert not chunk.choices[0].delta.tool_calls
        content += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    assert (content, reason) == (choice.message.content, "stop")


def test_openai_fields_a_client_sends_are_taken_as_openai_and_vllm_take_them(server):
    """Nulls OpenAI allows; a response's message sent back as model_dump() gives it;
    OpenAI's fields that change nothing here; text parts joined by a newline, as vLLM's."""
    client = server.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=None, stream=None, store=False, metadata={"run": "1"},
        service_tier="auto", prompt_cache_key="k", safety_identifier="u",
    )  # fmt: skip
    message = reply.choices[0].message.model_dump()
    assert message["refusal"] is None and message["audio"] is None
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}, message,
                               {"role": "user", "content": "More"}], max_tokens=2,
    )  # fmt: skip
    assert again.choices[0].finish_reason == "length"
    status, _, body = call(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "reasoning_effort": "high"})  # fmt: skip
    assert (status, body["error"]["param"]) == (400, "reasoning_effort")
    status, _, body = call(server, "POST", "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "One."},
                                     {"type": "text", "text": "Two."}]}]})  # fmt: skip
    _, _, joined = call(server, "POST", "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "One.\nTwo."}]})  # fmt: skip
    assert status == 200 and body["tokens"] == joined["tokens"]
    status, _, body = call(
        server,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "echo": None, "stream": None},
    )
    assert status == 200 and body["choices"][0]["text"]


def test_streamed_text_offsets_and_stop_reasons_are_the_whole_answer_s(server):
    """A streamed completion's text_offset counts the characters streamed before, as the
    whole answer's does; stop_reason is the stop token id of the request's that ended it
    (for EOS None: tests/test_request.py)."""
    client = server.client()
    body = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                logprobs=1)  # fmt: skip
    whole = client.completions.create(**body).choices[0].logprobs.text_offset
    streamed = [
        offset
        for chunk in client.completions.create(**body, stream=True)
        for offset in (chunk.choices[0].logprobs.text_offset if chunk.choices[0].logprobs else [])
    ]
    assert streamed == whole and whole[-1] > 0
    _, _, tokens = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "."})
    [period] = tokens["tokens"]
    stopped = client.completions.create(**body, extra_body={"stop_token_ids": [period]})
    assert stopped.choices[0].text == " Paris"  # the embedded model's answer, to its "."
    assert stopped.choices[0].model_extra["stop_reason"] == period


def test_an_extra_end_of_sequence_id_is_a_stop_token_s_stop_reason(tmp_path):
    """A generation_config.json that ends sequences on ids besides the tokenizer's EOS
    (Llama 3.1 Instruct's <|eom_id|> and <|end_of_text|> beside <|eot_id|>): vLLM makes
    those stop token ids, so an output that ends on one has it as stop_reason; the
    tokenizer's EOS stays None, and with ignore_eos the extra one does not end it either."""
    model = embedded.default_model_path(progress=False)
    [period] = transformers.AutoTokenizer.from_pretrained(model).encode(".")
    folder = tmp_path / MODEL  # the folder's name is the served model's
    folder.mkdir()
    for file in Path(model).iterdir():
        if file.name != "generation_config.json":
            (folder / file.name).symlink_to(file)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, period]}))
    server = Server("--model", str(folder))
    try:
        client = server.client()
        body = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        [choice] = client.completions.create(**body).choices
        assert (choice.text, choice.finish_reason) == (" Paris", "stop")  # no stop token text
        assert choice.model_extra["stop_reason"] == period
        [last] = list(client.completions.create(**body, stream=True))[-1].choices
        assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", period)
        [eos] = client.completions.create(**body, logit_bias={"2": 100}).choices
        assert (eos.text, eos.finish_reason, eos.model_extra["stop_reason"]) == ("", "stop", None)
        [on] = client.completions.create(**body, extra_body={"ignore_eos": True}).choices
        assert on.finish_reason == "length" and on.text.startswith(" Paris.")
    finally:
        server.stop()
