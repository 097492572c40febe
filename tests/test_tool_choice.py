"""A chat request's tools and tool_choice (serve/tools.py), without a server: the schema
that forces "required" and a named function, parallel_tool_calls, $defs moved to the
top, and which parser reads the reply."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from zmqworker.serve.errors import APIError
from zmqworker.serve.protocol import ChatCompletionRequest
from zmqworker.serve.tool_parsers import HermesParser
from zmqworker.serve.tool_parsers.forced import NamedParser, RequiredParser
from zmqworker.serve.tools import ToolOptions

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}},
        "required": ["to"], "$defs": {"point": POINT}}}},
    {"type": "function", "function": {"name": "stop"}},
]  # fmt: skip


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    parsed = msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)
    parsed.check()
    return parsed


def test_required_is_an_array_of_the_tools_calls():
    body = request(tools=TOOLS, tool_choice="required")
    schema = json.loads(body.structured_params().json)
    assert schema["$defs"] == {"point": POINT} and "maxItems" not in schema
    calls = [{"name": "move", "parameters": {"to": {"x": 1}}}, {"name": "stop", "parameters": {}}]
    jsonschema.validate(calls, schema)
    for wrong in ([], [{"name": "move", "parameters": {"to": {"x": "a"}}}],
                  [{"name": "jump", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert isinstance(body.tool_parser(ToolOptions()), RequiredParser)
    assert body.structured_field() == "tools"
    one = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(one.structured_params().json)["maxItems"] == 1


def test_a_named_function_is_its_parameters():
    body = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "stop"}})
    assert json.loads(body.structured_params().json) == {"type": "object", "properties": {}}
    parser = body.tool_parser(ToolOptions())
    assert isinstance(parser, NamedParser) and parser.name == "stop"


def test_auto_needs_the_servers_parser_and_none_reads_nothing():
    body = request(tools=TOOLS)  # tool_choice "auto" when tools are given
    assert body.structured_params() is None
    parser = body.tool_parser(ToolOptions("hermes"))
    assert isinstance(parser, HermesParser) and parser.names == {"move", "stop"}  # calls' names
    with pytest.raises(APIError, match="--enable-auto-tool-choice and --tool-call-parser"):
        body.tool_parser(ToolOptions())
    assert request(tools=TOOLS, tool_choice="none").tool_parser(ToolOptions()) is None
    assert request().tool_parser(ToolOptions()) is None  # no tools: "none"
    assert request(tools=TOOLS).template_tools()[1] == {
        "type": "function",
        "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}},
    }


def test_defs_that_clash_are_refused():
    clash = json.loads(json.dumps(TOOLS))
    clash[1]["function"]["parameters"] = {"type": "object", "$defs": {"point": {"type": "string"}}}
    with pytest.raises(APIError) as caught:
        request(tools=clash, tool_choice="required")
    assert caught.value.param == "tools[1].function.parameters"
