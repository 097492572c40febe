"""zmqworker serve against bad and outsized input, over real sockets: a maximal body does
not hold the server (/health and a live stream answer while it is prepared), a body past
--max-request-bytes is refused before it is read, text that is not valid Unicode and
unsupported features get a 400 that says so and names the field; logprobs are bounded
by the server's --max-logprobs (30 here), not by OpenAI's 20."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import string
import urllib.request

import openai
import pytest
from engine_helpers import byte_level_tokenizer

from messages import SamplingParams
from tests import bad_input_table
from tests.test_serve import MODEL, Server
from zmqworker.cli import build_parser
from zmqworker.engine.model_folder import TextSide
from zmqworker.engine.prompts import check_text, prompt_token_ids
from zmqworker.serve.body_limit import DEFAULT_MAX_REQUEST_BYTES
from zmqworker.serve.protocol import MAX_PROMPTS

LIMIT = 2 << 20  # the test server's --max-request-bytes
HELLO = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
TEXT_PART = {"type": "text", "text": "What is this?"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}


@pytest.fixture(scope="module")
def server():
    # One torch thread: the tokenizer's thread then leaves the worker a core of its own
    # on a two-core machine (torch's threads wait for each other at every op, so a
    # worker sharing its cores stalls for a second at a time, /health with it).
    srv = Server("--max-request-bytes", "2MiB", "--num-threads", "1", "--max-logprobs", "30")
    yield srv
    srv.stop()


def post(server: Server, path: str, body: bytes | dict) -> tuple[int, dict]:
    """(status, decoded JSON) of a POST whose body is sent exactly as given. A server that
    refuses a body by its Content-Length answers before reading it and closes, which
    can break the send: the answer is read all the same, as curl reads it."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def health(server: Server) -> int:
    with urllib.request.urlopen(f"{server.base}/health", timeout=120) as response:
        return response.status


def send_then_read(server: Server, head: bytes, body_part: bytes) -> bytes:
    """Send a request's head and part of its body, stop sending, and read the response."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body_part)
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection without an answer: {data!r}"
            data += chunk
        return data


def test_health_and_a_stream_answer_while_a_maximal_request_is_prepared(server):
    """A prompt just under the bound takes the tokenizer seconds (and is then refused as
    longer than the model): all that while the event loop serves the others."""
    head = json.dumps({"model": MODEL, "prompt": ""})[:-2].encode()
    random.seed(0)  # letters without spaces: among the slowest text to tokenize
    letters = "".join(random.choices(string.ascii_lowercase, k=LIMIT - len(head) - 2))
    big_body = head + letters.encode() + b'"}'
    assert len(big_body) == LIMIT

    async def scenario() -> tuple[list[str], dict]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused")
        stream = await client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=480, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokens = aiter(stream)
        await anext(tokens)
        events: list[str] = []
        big = asyncio.create_task(asyncio.to_thread(post, server, "/v1/completions", big_body))
        big.add_done_callback(lambda _: events.append("big done"))

        async def next_token() -> None:
            token = asyncio.ensure_future(anext(tokens))
            done, _ = await asyncio.wait([token, big], return_when=asyncio.FIRST_COMPLETED)
            if token not in done:
                token.cancel()
            elif token.exception() is None:
                events.append("token")

        await next_token()  # the server has the big body: a blocked loop streams nothing
        events.append(f"health {await asyncio.to_thread(health, server)}")
        await next_token()
        _, answer = await big
        await stream.close()
        await client.close()
        return events, answer

    events, answer = asyncio.run(scenario())
    assert events.index("health 200") < events.index("big done"), events
    assert "token" in events[events.index("health 200") : events.index("big done")], events
    assert "more than max_model_len=512" in answer["error"]["message"]


def test_a_body_declared_over_the_bound_is_refused_before_it_is_read(server):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100 * LIMIT}\r\n\r\n"
    ).encode()
    answer = send_then_read(server, head, b'{"model": "x", "prompt": "' + b"a" * 1000)
    assert answer.startswith(b"HTTP/1.1 413 ")
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"] == (
        f"the request body of {100 * LIMIT} bytes is larger than this server takes: "
        f"at most {LIMIT} bytes (--max-request-bytes)"
    )
    assert error["type"] == "invalid_request_error" and error["param"] is None


def test_a_chunked_body_over_the_bound_is_refused(server):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"a" * 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(LIMIT // 65536 + 1))
    answer = send_then_read(server, head, chunks)  # no last chunk: the body never ends
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"at most 2097152 bytes (--max-request-bytes)" in answer
    assert health(server) == 200


SURROGATE = '"Hello \\udcff"'  # a lone surrogate, as JSON writes it


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": {SURROGATE}}}', "prompt"),
        ("/v1/completions", f'{{"model": "{MODEL}", "prompt": ["Hi", {SURROGATE}]}}', "prompt[1]"),
        (
            "/v1/completions",
            f'{{"model": "{MODEL}", "prompt": "Hi", "stop": [{SURROGATE}]}}',
            "stop[0]",
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], '
            f'"stop": {SURROGATE}}}',
            "stop",
        ),
    ],
)
def test_text_that_is_not_unicode_is_refused_naming_its_field(server, path, body, param):
    status, answer = post(server, path, body.encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["message"] == (
        f"{param} is not valid Unicode text: it holds a lone surrogate '\\udcff' at "
        "character 7 (text must be encodable as UTF-8)"
    )
    assert "Traceback" not in server.output() and "TypeError" not in server.output()


def test_a_json_syntax_error_gives_line_and_column(server):
    status, answer = post(server, "/v1/completions", b'{"model": "x",\n  "prompt": "Hi",, }')
    assert status == 400
    assert answer["error"]["param"] is None
    assert answer["error"]["message"] == (
        "JSON syntax error at line 2, column 18: object keys must be strings"
    )


COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "changes", "param", "message"),
    [
        (COMPLETIONS, {"n": 129}, "n", "n: must be <= 128"),
        (COMPLETIONS, {"n": 3, "best_of": 2}, "best_of", "best_of=2 with n=3: best_of must be"),
        (COMPLETIONS, {"suffix": "!"}, "suffix", "suffix is not supported"),
        (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: must"),
        (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty: "),
        *[
            (
                COMPLETIONS,
                {"logit_bias": {key: 5}},
                "logit_bias",
                f"logit_bias: key {key!r} is not a token id: keys are token ids (integers in "
                "[0, vocabulary size)) in plain decimal digits, without sign, spaces or leading",
            )
            for key in ("-1", " 5", "5 ", "05", "+5", "0x5", "1e3", "\u0665")
        ],
        (
            COMPLETIONS,
            {"logit_bias": {"4294967296": 5}},
            "logit_bias",
            "logit_bias: key '4294967296' is not a token id: token ids are integers in "
            "[0, vocabulary size), at most 2147483647",
        ),
        (
            COMPLETIONS,
            {"allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids is empty: it would allow no token (None allows every token)",
        ),
        (
            CHAT_COMPLETIONS,
            {"allowed_token_ids": [7, -1]},
            "allowed_token_ids",
            "allowed_token_ids: token id -1 is outside the vocabulary (token ids are in [0, ",
        ),
        (
            COMPLETIONS,
            {"allowed_token_ids": [7, 49152]},
            "allowed_token_ids",
            "allowed_token_ids: token id 49152 is outside the vocabulary [0, 49152)",
        ),
        (COMPLETIONS, {"use_beam_search": True}, "use_beam_search", "use_beam_search is not"),
        (COMPLETIONS, {"priority": -1}, "priority", "priority is not supported"),
        (CHAT_COMPLETIONS, {"cache_salt": "s"}, "cache_salt", "cache_salt is not supported"),
        (CHAT_COMPLETIONS, {"function_call": "auto"}, "function_call", "function_call is not"),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "assistant", "content": "Hi", "annotations": [{}]}]},
            "messages[0].annotations",
            "messages[0].annotations is not supported: only null or []",
        ),
        (COMPLETIONS, {"bad_words": [""]}, "bad_words[0]", "bad_words[0]: must not be empty"),
        (CHAT_COMPLETIONS, {"tools": [{"type": "function"}]}, "tools[0].function", "tools[0]"),
        (CHAT_COMPLETIONS, {"tool_choice": "auto"}, "tool_choice", 'tool_choice "auto" needs'),
        (
            CHAT_COMPLETIONS,
            {"response_format": {"type": "json_schema"}},
            "response_format",
            'response_format of type "json_schema" needs json_schema.schema',
        ),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": [TEXT_PART, IMAGE_PART]}]},
            "messages[0].content[1]",
            "image content parts are not supported: only text",
        ),
        (
            COMPLETIONS,
            {"prompt": [1, 2, 3, -1]},
            "prompt",
            "prompt: token ids must be >= 0, got -1 at index 3",
        ),
        (COMPLETIONS, {"prompt": [[1], [2, -5]]}, "prompt[1]", "prompt[1]: token ids must be"),
        (COMPLETIONS, {"prompt": ["Hi", 1]}, "prompt", "prompt: expected a text, a list of"),
        (
            COMPLETIONS,
            {"prompt": [[1]] * (MAX_PROMPTS + 1)},
            "prompt",
            f"prompt: {MAX_PROMPTS + 1} prompts in one request, more than the {MAX_PROMPTS} ",
        ),
        (COMPLETIONS, {"max_tokens": "8"}, "max_tokens", "max_tokens: expected an integer"),
        (COMPLETIONS, {"model": 5}, "model", "model: expected a string or null, got an integer"),
        (COMPLETIONS, {"logprobs": 31}, "logprobs", "logprobs=31 is more than max_logprobs=30"),
        (
            CHAT_COMPLETIONS,
            {"logprobs": True, "top_logprobs": 31},
            "top_logprobs",
            "top_logprobs=31 is more than max_logprobs=30",
        ),
    ],
)
def test_what_is_wrong_or_not_supported_is_said_plainly(server, path, changes, param, message):
    status, answer = post(
        server, path, {**(CHAT if path == CHAT_COMPLETIONS else HELLO), **changes}
    )
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["message"].startswith(message), answer


def test_logprobs_up_to_the_server_s_max_logprobs_are_served(server):
    """A hard-coded bound of 20 refused 25 on a server started with more."""
    status, answer = post(server, COMPLETIONS, {**HELLO, "max_tokens": 1, "logprobs": 25})
    assert status == 200, answer
    [top] = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) in (25, 26)  # the sampled token, and the 25 most likely
    chat = {**CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 25}
    status, answer = post(server, CHAT_COMPLETIONS, chat)
    assert (
        status == 200 and len(answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    )


def test_requests_within_the_bound_still_work(server):
    status, answer = post(server, COMPLETIONS, {**HELLO, "prompt": [[1, 2], [3, 4]]})
    assert status == 200 and len(answer["choices"]) == 2
    parts = {"messages": [{"role": "user", "content": [TEXT_PART]}]}
    status, answer = post(server, CHAT_COMPLETIONS, {**CHAT, **parts})
    assert status == 200 and answer["choices"][0]["message"]["content"]


# vLLM's own fields at the values its clients send when they ask for nothing.
VLLM_NEUTRAL = {
    "use_beam_search": False, "length_penalty": 1.0, "priority": 0, "cache_salt": None,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "logits_processors": [],
    "return_tokens_as_token_ids": False, "kv_transfer_params": None, "vllm_xargs": {},
}  # fmt: skip


def test_what_is_not_supported_is_taken_at_its_neutral_value(server):
    """An assistant message sent back with empty annotations, OpenAI's old function
    calling turned off, vLLM's own fields at their defaults: each asks for nothing."""
    status, answer = post(server, COMPLETIONS, {**HELLO, **VLLM_NEUTRAL})
    assert status == 200 and answer["choices"][0]["text"], answer
    reply = {"role": "assistant", "content": "Hey", "annotations": [], "refusal": None}
    messages = [*CHAT["messages"], reply, {"role": "user", "content": "More"}]
    chat = {**CHAT, **VLLM_NEUTRAL, "messages": messages, "function_call": "none",
            "functions": [], "documents": None, "chat_template": None}  # fmt: skip
    status, answer = post(server, CHAT_COMPLETIONS, chat)
    assert status == 200 and answer["choices"][0]["message"]["content"], answer


def test_no_cors_headers_without_allowed_origins(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
        response = conn.getresponse()
        response.read()
    finally:
        conn.close()
    assert response.status == 200 and response.getheader("x-request-id")
    assert not [h for h, _ in response.getheaders() if h.lower().startswith("access-control")]


def test_the_engine_refuses_text_that_is_not_unicode():
    """The check the server, the CLI and the LLM share (zmqworker/engine/prompts.py)."""
    check_text("Hello 👋", "the prompt")
    with pytest.raises(ValueError, match=r"prompt 2 is not valid Unicode text: .* character 7"):
        check_text("Hello \udcff", "prompt 2")
    with pytest.raises(ValueError, match="the prompt is not valid Unicode text"):
        prompt_token_ids("Hello \udcff", object(), 512, None)
    tok = byte_level_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = TextSide(tok, SamplingParams(), frozenset()).chat_prompt
    assert tok.decode(chat([{"role": "user", "content": "Hi"}])) == "Hi"
    with pytest.raises(ValueError, match="message 1's content is not valid Unicode text"):
        chat([{"role": "user", "content": "Hi"}, {"role": "user", "content": "\udcff"}])


def test_max_request_bytes_takes_a_size_of_at_least_one_byte(capsys):
    parser, commands = build_parser()
    assert parser.parse_args(["serve", "--max-request-bytes", "1MiB"]).max_request_bytes == 2**20
    for bad in ("0", "4XB"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max-request-bytes", bad])
        assert "argument --max-request-bytes" in capsys.readouterr().err
    help_text = " ".join(commands["serve"].format_help().split())
    assert f"(default: {DEFAULT_MAX_REQUEST_BYTES >> 20}MiB;" in help_text


def body_of(size: int) -> bytes:
    """A completions body of exactly size bytes."""
    head = json.dumps({"model": MODEL, "prompt": ""})[:-2].encode()
    return head + b"a" * (size - len(head) - 2) + b'"}'


@pytest.mark.parametrize(
    "row", bad_input_table.rows("`zmqworker serve`"), ids=lambda row: row[0][:60]
)
def test_the_bad_input_page_is_what_serve_answers(server, row):
    request, status, param, message = row
    path, body = bad_input_table.code(request)
    made = {"<3,000,000 bytes>": body_of(3_000_000).decode()}
    got_status, answer = post(server, path, bad_input_table.resolve(body, made).encode())
    assert got_status == int(status), answer
    assert answer["error"]["param"] == (bad_input_table.code(param) or [None])[0]
    assert answer["error"]["message"] == bad_input_table.code(message)[0]
