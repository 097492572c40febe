"""Tool calling on /v1/chat/completions, as vLLM's server takes it: the request's tools
(rendered by the chat template), tool_choice ("none", "auto", "required" or a named
function) and parallel_tool_calls, checked before anything runs.

"auto" reads calls out of free text with the server's parser (--enable-auto-tool-choice
--tool-call-parser, serve/tool_parsers/). "required" and a named function constrain the
output with structured outputs instead, so that it always parses: a JSON array of
{"name", "parameters"} objects, one of the tools' each, or the named function's
parameters alone. "none" renders the tools and reads no calls, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta, Struct

from messages import StructuredOutputsParams
from zmqworker.serve.errors import APIError
from zmqworker.serve.tool_parsers import TOOL_PARSERS, ToolParser
from zmqworker.serve.tool_parsers.forced import NamedParser, RequiredParser

CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDefinition


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


@dataclass(frozen=True)
class ToolOptions:
    """The server's: the parser "auto" reads calls with (None: "auto" is refused)."""

    parser: str | None = None


class ToolFields:
    """The rules of the fields, mixed into the chat request's body, which declares them
    (a msgspec struct has fields from one line of bases only)."""

    __slots__ = ()
    tools: list[Tool] | None
    tool_choice: str | NamedToolChoice | None
    parallel_tool_calls: bool | None

    def choice(self) -> str | NamedToolChoice:
        """tool_choice, with vLLM's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check_tools(self) -> None:
        """Refuse tools and a tool_choice that cannot go together, naming the field."""
        names = check_tools(self.tools)
        choice = self.choice()
        if isinstance(choice, str):
            if choice not in CHOICES:
                raise APIError(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", '
                    f'"function": {{"name": ...}}}}, got {choice!r}',
                    param="tool_choice",
                )
            if choice != "none" and not self.tools:
                raise APIError(f'tool_choice "{choice}" needs tools', param="tool_choice")
            return
        if choice.type != "function":
            raise APIError(
                f'tool_choice.type must be "function", got {choice.type!r}',
                param="tool_choice.type",
            )
        if choice.function.name not in names:
            raise APIError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                param="tool_choice.function.name",
            )

    def forced(self) -> bool:
        """Whether tool_choice forces calls through structured outputs."""
        return self.choice() not in ("none", "auto")

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """The structured output that forces the calls ("required", a named function)."""
        choice = self.choice()
        if choice == "required":
            return StructuredOutputsParams(json=_calls_schema(self.tools or [], self.parallel()))
        if isinstance(choice, NamedToolChoice):
            tool = next(t for t in self.tools or [] if t.function.name == choice.function.name)
            return StructuredOutputsParams(json=tool.function.parameters or NO_PARAMETERS)
        return None

    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's shape)."""
        return template_tools(self.tools)

    def tool_parser(self, options: ToolOptions) -> ToolParser | None:
        """What reads the reply's calls (None: the reply is content)."""
        choice = self.choice()
        if choice == "none":
            return None
        if choice == "required":
            return RequiredParser()
        if isinstance(choice, NamedToolChoice):
            return NamedParser(choice.function.name)
        if options.parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (tool_choice defaults to "auto" when tools are given)',
                param="tool_choice",
            )
        return TOOL_PARSERS[options.parser](frozenset(t.function.name for t in self.tools or []))


def check_tools(tools: list[Tool] | None) -> set[str]:
    """The tools' names; refuses a tool that is not a function, or a name twice."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise APIError(
                f'tools[{i}].type must be "function", got {tool.type!r}',
                param=f"tools[{i}].type",
            )
        if tool.function.name in names:
            raise APIError(
                f"tools[{i}]: two tools are named {tool.function.name!r}",
                param=f"tools[{i}].function.name",
            )
        names.add(tool.function.name)
    return names


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template takes them (OpenAI's shape); None: no tools."""
    if not tools:
        return None
    return [{"type": "function", "function": _function(tool.function)} for tool in tools]


def _function(function: FunctionDefinition) -> dict[str, Any]:
    given = {"name": function.name, "description": function.description}
    given["parameters"] = function.parameters or NO_PARAMETERS
    return {k: v for k, v in given.items() if v is not None}


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """An array of calls, each {"name": one of the tools', "parameters": its arguments}.
    The tools' $defs move to the top, where their "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        given_defs = parameters.pop("$defs", {})
        if not isinstance(given_defs, dict):
            raise APIError(
                f"tools[{i}].function.parameters.$defs must be an object",
                param=f"tools[{i}].function.parameters",
            )
        for name, schema in given_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(
                    f"tools[{i}]: its parameters' $defs name {name!r} differently from another "
                    'tool\'s, so tool_choice "required" cannot hold both',
                    param=f"tools[{i}].function.parameters",
                )
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
