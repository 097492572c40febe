"""The structured-output fields a request may carry, as vLLM's server reads them: OpenAI's
response_format ({"type": "json_object"}, {"type": "json_schema", "json_schema":
{"schema": ...}}), vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" |
"json_object": ...}) and its older guided_json / guided_regex / guided_choice /
guided_grammar. At most one of them may be given; each becomes StructuredOutputsParams.
vLLM's options beside a constraint (structured_outputs' disable_any_whitespace, ...,
guided_decoding_backend) are taken where they change nothing here (unsupported.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from messages import StructuredOutputsParams
from zmqworker.serve.errors import APIError
from zmqworker.serve.unsupported import STRUCTURED_UNSUPPORTED, refuse_unsupported

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' own


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(Struct, forbid_unknown_fields=True):
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options, not constraints.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None


class StructuredFields(Struct, kw_only=True):
    """The fields, mixed into both endpoints' request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_field(self) -> str | None:
        """The name of the structured-output field the request gives (errors name it)."""
        for name in ("response_format", "structured_outputs", *_GUIDED):
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.type == "text"):
                return name
        return None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's constraint; an APIError naming the field that is wrong."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            given.append(("response_format", _response_format(fmt)))
        if self.structured_outputs is not None:
            at = "structured_outputs."
            refuse_unsupported(self.structured_outputs, STRUCTURED_UNSUPPORTED, at)
            body = msgspec.structs.asdict(self.structured_outputs)
            # Set is not None, but json {} ("any JSON"); json_object false is unset.
            kinds = {
                k: v for k, v in body.items() if k in _KINDS and v is not None and v is not False
            }
            given.append(("structured_outputs", kinds))
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for kind, value in guided.items():
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise APIError(f"give one structured-output field, not several: {names}")
        name, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise APIError(str(exc).replace("structured_outputs", name, 1), param=name) from None


def _response_format(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise APIError(
                'response_format of type "json_schema" needs json_schema.schema',
                param="response_format",
            )
        return {"json": fmt.json_schema.schema}
    raise APIError(
        f'response_format.type must be "text", "json_object" or "json_schema", got {fmt.type!r}',
        param="response_format",
    )
