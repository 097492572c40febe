"""Tool calling through `zmqworker serve --enable-auto-tool-choice --tool-call-parser
hermes`, with the official openai client: tool_choice "required" and a named function
(forced by structured outputs: every call parses and validates), "auto" (the embedded
model is too small to choose a call, so a regex forces it to write one: the parser reads
it), "none", each whole and streamed; conversations with tool calls and results through
the chat template, and /tokenize's rendering of them; bad tools and tool_choice refused
with a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request

import jsonschema
import openai
import pytest
import transformers

from tests.hermes_template import TEMPLATE, hermes_model
from tests.test_serve import MODEL, Server
from zmqworker.models.embedded import default_model_path

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
# What "auto" is made to write: text, then a Hermes call with a city the model picks.
FORCED_CALL = (
    r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,5}", "unit": "celsius"\}\}</tool_call>'
)


NAMED = {"type": "function", "function": {"name": "get_time"}}
FORCED = {"structured_outputs": {"regex": FORCED_CALL}}
CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
CONVERSATION = [
    *CHAT,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 degrees, sunny"},
]
# Every generation the tests look at, sent at once: the engine batches them. The fewer
# tools, the shorter the prompt: a CPU prefills them all.
TIME_ONLY, WEATHER_ONLY = {"tools": TOOLS[1:]}, {"tools": TOOLS[:1]}
REQUESTS = {
    "required": {"tool_choice": "required", "n": 2, "temperature": 1.0, "seed": 1},
    "required_streamed": {"tool_choice": "required", "seed": 2, "stream": True},
    "named": {"tool_choice": NAMED, "n": 2, "temperature": 1.0, "seed": 4, **TIME_ONLY},
    "named_streamed": {"tool_choice": NAMED, "seed": 5, "stream": True, **TIME_ONLY},
    "auto": {"tool_choice": "auto", "seed": 6, "extra_body": FORCED, **WEATHER_ONLY},
    # tool_choice left out: "auto", the default with tools.
    "auto_streamed": {"seed": 6, "extra_body": FORCED, "stream": True, **WEATHER_ONLY},
    "none": {"tool_choice": "none", "seed": 7, "extra_body": FORCED, **WEATHER_ONLY},
    "none_streamed": {
        "tool_choice": "none",
        "seed": 7,
        "extra_body": FORCED,
        "stream": True,
        **WEATHER_ONLY,
    },
    "bare": {"tools": None, "max_tokens": 1},
    "with_tools": {"tool_choice": "none", "max_tokens": 1},
    "conversation": {"messages": CONVERSATION, "tool_choice": "none", "max_tokens": 1},
}
pytestmark = pytest.mark.timeout(900)  # the first test waits for all of them


@pytest.fixture(scope="module")
def server():
    folder = hermes_model()
    srv = Server(
        "--model", folder, "--served-model-name", MODEL,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield srv
    srv.stop()
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def replies(server):
    """Each of REQUESTS' reply: a ChatCompletion, or a stream as (content, calls, reason)."""
    client = openai.AsyncOpenAI(
        base_url=f"{server.base}/v1", api_key="unused", timeout=900, max_retries=0
    )

    async def one(changes: dict):
        reply = await client.chat.completions.create(**{**ARGS, **changes})
        if not changes.get("stream"):
            return reply
        return collect([chunk async for chunk in reply])

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(r) for r in REQUESTS.values()))
        finally:
            await client.close()

    return dict(zip(REQUESTS, asyncio.run(all_of_them()), strict=True))


ARGS = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 60}


def collect(chunks) -> tuple[str, list[dict], str]:
    """(content, calls as {"id", "name", "arguments"}, finish_reason) of a stream, put
    together as a client does: a call's first delta names it, the others add arguments."""
    content, calls, reason = "", [], None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.id is not None:
                assert entry.index == len(calls) and entry.type == "function"
                calls.append({"id": entry.id, "name": entry.function.name, "arguments": ""})
            calls[entry.index]["arguments"] += entry.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_valid_calls_whole_and_streamed(replies):
    for choice in replies["required"].choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            valid(call.function.name, call.function.arguments)
    content, calls, reason = replies["required_streamed"]
    assert reason == "tool_calls" and content == "" and calls
    for call in calls:
        valid(call["name"], call["arguments"])


def test_a_named_function_is_called_whole_and_streamed(replies):
    for answer in replies["named"].choices:
        [call] = answer.message.tool_calls
        assert call.function.name == "get_time" and answer.finish_reason == "stop"
        valid("get_time", call.function.arguments)
    content, [call], reason = replies["named_streamed"]
    assert call["name"] == "get_time" and reason == "stop" and content == ""
    valid("get_time", call["arguments"])


def test_auto_reads_the_call_the_model_writes(replies):
    choice = replies["auto"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    valid("get_weather", call.function.arguments)
    content, [streamed], reason = replies["auto_streamed"]  # the same seed: the same reply
    assert (content, reason) == ("Checking.\n", "tool_calls")
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", call.function.arguments)


def test_none_reads_no_calls(replies):
    message = replies["none"].choices[0].message
    assert "<tool_call>" in message.content and not message.tool_calls
    assert replies["none"].choices[0].finish_reason == "stop"
    assert replies["none_streamed"] == (message.content, [], "stop")


def test_tools_calls_and_results_go_through_the_template(replies):
    bare, with_tools = replies["bare"].usage, replies["with_tools"].usage
    assert with_tools.prompt_tokens > bare.prompt_tokens + 50  # the tools' text
    after = replies["conversation"].usage
    assert after.prompt_tokens > with_tools.prompt_tokens + 20  # the call and its result


def test_tokenize_renders_the_tools_as_the_chat_template_does(server):
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS}
    request = urllib.request.Request(
        f"{server.base}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        tokens = json.loads(response.read())["tokens"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path(progress=False))
    text = tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert "get_time" in text and tokens == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("changes", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", '"function"'),  # noqa: E501
        ({"tools": TOOLS * 2}, "tools[2].function.name", "two tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "'nope', which is not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
          "tools": [{"type": "function", "function": {"name": "get_time",
                                                      "parameters": {"type": 5}}}]},
         "tools", "json"),
        ({"messages": [*CHAT, {"role": "tool", "content": "21"}]}, "messages[1].tool_call_id",
         "required"),
        ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content", "required"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(server, changes, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(**{**ARGS, "max_tokens": 2, **changes})
    error = caught.value.body
    assert words in error["message"] and error["param"] == param, error


def test_auto_tool_choice_needs_a_parser_before_the_server_starts():
    done = subprocess.run(
        [sys.executable, "-m", "zmqworker", "serve", "--enable-auto-tool-choice"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "--enable-auto-tool-choice needs --tool-call-parser" in (
        done.stderr
    )
