"""The tool-call parsers on crafted model outputs: one call, several, text before a call,
malformed JSON left as content, objects that are no call (no arguments, a function the
request's tools do not hold) left as content; and a stream cut at every character gives
the calls and content of the whole text (serve/tool_calls.ToolCallStream)."""

from __future__ import annotations

import json
import random

import pytest

from zmqworker.serve.tool_calls import ToolCallStream, tool_message
from zmqworker.serve.tool_parsers import HermesParser, Llama3JsonParser
from zmqworker.serve.tool_parsers.forced import NamedParser, RequiredParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
HERMES_TWO = (
    f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET \\"}\\""}}\n</tool_call>'
)
LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)


def calls(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]


def test_hermes_one_call_several_and_text_before():
    one = tool_message(HermesParser(), f"<tool_call>\n{WEATHER}\n</tool_call>", True)
    assert calls(one) == [("get_weather", {"city": "Paris", "days": [1, 2]})]
    assert one["content"] is None and one["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert len(one["tool_calls"][0]["id"]) == len("chatcmpl-tool-") + 32
    two = tool_message(HermesParser(), HERMES_TWO, True)
    assert two["content"] == "Let me look.\n"
    assert calls(two) == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"zone": 'CET "}"'}),
    ]
    assert calls(tool_message(HermesParser(), HERMES_TWO, parallel=False)) == calls(two)[:1]
    # The model stopped right after the object, before the closing tag.
    unclosed = tool_message(HermesParser(), f"<tool_call>{WEATHER}", True)
    assert calls(unclosed)[0][0] == "get_weather"


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no call.",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # unbalanced
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments (vLLM's parser needs them)
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>',  # arguments not an object
        f"<tool_call>{WEATHER}</tool_call><tool_call>not json</tool_call>",
        f"<tool_call>{WEATHER} {WEATHER}</tool_call>",
    ],
)
def test_hermes_malformed_calls_are_content(text):
    assert tool_message(HermesParser(), text, True) == {"role": "assistant", "content": text}


def test_llama3_json_calls_and_content():
    two = tool_message(Llama3JsonParser(), LLAMA_TWO, True)
    assert calls(two) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert two["content"] is None
    bare = tool_message(Llama3JsonParser(), ' {"name": "f", "arguments": {"x": [1]}}', True)
    assert calls(bare) == [("f", {"x": [1]})]
    for text in ('I would call {"name": "f", "parameters": {}}', '{"name": "f", "parameters": {',
                 '{"name": "f"} and more', "{}"):  # fmt: skip
        assert tool_message(Llama3JsonParser(), text, True) == {
            "role": "assistant", "content": text
        }  # fmt: skip


TOOLS = frozenset({"get_weather", "get_time"})


def test_an_object_that_is_no_call_of_the_request_s_tools_is_content():
    """A JSON reply with a "name" (response_format json_object under tool_choice "auto")
    was read as a call of "John" with arguments {}; an unknown function, or a call without
    its arguments key, is no call either (vLLM's parsers need the key)."""
    for text in (
        '{"name": "John", "age": 25}',
        '{"name": "John", "parameters": {}}',
        '{"name": "get_weather"}',
        '<|python_tag|>{"name": "nope", "arguments": {}}',
        '{"name": "get_weather", "parameters": {}}; {"name": "John", "age": 1}',
    ):
        assert tool_message(Llama3JsonParser(TOOLS), text, True) == {
            "role": "assistant", "content": text
        }  # fmt: skip
    call = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    assert calls(tool_message(Llama3JsonParser(TOOLS), call, True)) == [
        ("get_time", {"zone": "CET"})
    ]
    for text in (
        '<tool_call>{"name": "John", "arguments": {}}</tool_call>',
        f"<tool_call>{WEATHER}</tool_call>"
        + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    ):
        assert tool_message(HermesParser(TOOLS), text, True) == {
            "role": "assistant", "content": text
        }  # fmt: skip
    assert calls(tool_message(HermesParser(TOOLS), f"<tool_call>{WEATHER}</tool_call>", True))
    # Streamed, a JSON reply goes out as content once its name shows it is no tool's.
    stream = ToolCallStream(Llama3JsonParser(TOOLS), parallel=True)
    assert stream.step('{"name": "Jo', final=False) == []
    assert stream.step('hn", "age"', final=False) == [{"content": '{"name": "John", "age"'}]
    assert not stream.called


def test_forced_shapes():
    required = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert calls(tool_message(RequiredParser(), required, True)) == [("a", {"x": 1}), ("b", {})]
    cut = '[{"name": "a", "parameters": {"x": '
    assert tool_message(RequiredParser(), cut, True) == {"role": "assistant", "content": cut}
    named = tool_message(NamedParser("f"), ' {"x": 2}\n', True)
    assert named["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 2}'}


def streamed(parser, pieces: list[str], parallel: bool = True) -> dict:
    """The message a client puts together from the stream of pieces."""
    stream = ToolCallStream(parser, parallel)
    content, tool_calls = "", {}
    for i, piece in enumerate([*pieces, ""]):
        for delta in stream.step(piece, final=i == len(pieces)):
            content += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                if "id" in entry:
                    assert entry["index"] == len(tool_calls) and entry["type"] == "function"
                    tool_calls[entry["index"]] = dict(entry["function"])
                else:
                    tool_calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    message = {"role": "assistant", "content": content or None}
    if tool_calls:
        message["tool_calls"] = [{"function": tool_calls[i]} for i in sorted(tool_calls)]
    return message


def whole(parser, text: str, parallel: bool = True) -> dict:
    message = tool_message(parser, text, parallel)
    for call in message.get("tool_calls", []):
        del call["id"], call["type"]
    return {**message, "content": message["content"] or None}


CASES = [
    (HermesParser, HERMES_TWO),
    (HermesParser, f"<tool_call>{WEATHER}"),
    (HermesParser, "Text with a <tool_cal that never comes"),
    (HermesParser, "<tool_call>not json</tool_call>"),
    (Llama3JsonParser, LLAMA_TWO),
    (Llama3JsonParser, '{"parameters": {"q": "}{"}, "name": "search"}'),
    (Llama3JsonParser, "<|python_ta is not a tag"),
    (Llama3JsonParser, "  plain text"),
    (
        RequiredParser,
        '[ {"name": "a", "parameters": {"x": [1, {"y": "]"}]}} ,{"name": "b", "parameters": {}}]',
    ),
    (lambda: NamedParser("f"), '\n {"x": 2, "s": "a b"} \n'),
    # Objects that are no call of the request's tools: content, streamed as content.
    (lambda: Llama3JsonParser(TOOLS), '{"name": "John", "age": 25}'),
    (lambda: Llama3JsonParser(TOOLS), '{"name": "John", "parameters": {"age": 25}}'),
    (lambda: Llama3JsonParser(TOOLS), '{"name": "get_weather", "city": "Paris"}'),
    (lambda: Llama3JsonParser(TOOLS), '{"name": "get_weather", "parameters": {"city": "X"}}'),
    (lambda: HermesParser(TOOLS), 'Hi <tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
]


@pytest.mark.parametrize(("make", "text"), CASES)
def test_a_stream_cut_at_every_character_gives_the_whole_parse(make, text):
    expected = whole(make(), text)
    assert streamed(make(), list(text)) == expected
    for cut in range(len(text) + 1):
        assert streamed(make(), [text[:cut], text[cut:]]) == expected
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), 4))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(make(), pieces) == expected
    assert streamed(make(), list(text), parallel=False) == whole(make(), text, parallel=False)


def test_arguments_stream_in_pieces_after_the_name():
    stream = ToolCallStream(HermesParser(), parallel=True)
    entries = [
        entry
        for char in f"Hi <tool_call>{WEATHER}</tool_call>"
        for delta in stream.step(char, final=False)
        for entry in delta.get("tool_calls", [])
    ]
    # The call opens with the name and the arguments' first character, then a piece a
    # character.
    assert entries[0]["function"] == {"name": "get_weather", "arguments": "{"}
    assert len(entries) == len('{"city": "Paris", "days": [1, 2]}')
