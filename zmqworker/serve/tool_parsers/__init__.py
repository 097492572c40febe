"""Reading tool calls out of a model's output: one parser per format (`--tool-call-parser`,
vLLM's names), and the forced shapes of tool_choice "required" and of a named function."""

from __future__ import annotations

from collections.abc import Callable, Collection

from zmqworker.serve.tool_parsers.calls import Parsed, ParsedCall, ToolParser
from zmqworker.serve.tool_parsers.hermes import HermesParser
from zmqworker.serve.tool_parsers.llama3_json import Llama3JsonParser

# Each made with the names of the request's tools: a call names one of them.
TOOL_PARSERS: dict[str, Callable[[Collection[str]], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}

__all__ = ["TOOL_PARSERS", "HermesParser", "Llama3JsonParser", "Parsed", "ParsedCall", "ToolParser"]
