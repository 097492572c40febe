"""A request's structured-output constraint, in vLLM's names (StructuredOutputsParams).

Exactly one kind is set: a JSON schema (json), any JSON object (json_object), a regular
expression (regex), one of a list of strings (choice), or a grammar (grammar: EBNF in the
GBNF dialect, whose start rule is `root`). The engine compiles it into a matcher that
masks each step's logits to the tokens that keep the output inside the constraint; the
workers never read it. A schema travels as JSON text: what a client passes as a dict is
encoded here, so that the wire carries a declared type only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """One constraint; a ValueError names what is wrong when none or several are set."""

    json: Annotated[
        str | None, Meta(description="a JSON schema (as JSON text, or a dict from Python)")
    ] = None
    json_object: Annotated[bool, Meta(description="any JSON object")] = False
    regex: Annotated[str | None, Meta(description="a regular expression")] = None
    choice: Annotated[list[str] | None, Meta(description="the output is one of these strings")] = (
        None
    )
    grammar: Annotated[str | None, Meta(description="an EBNF grammar whose start rule is root")] = (
        None
    )

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # a schema given from Python
            msgspec.structs.force_setattr(self, "json", msgspec.json.encode(self.json).decode())
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(set_kinds) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None:
            try:
                schema = msgspec.json.decode(self.json)
            except msgspec.DecodeError as exc:
                raise ValueError(f"structured_outputs.json is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(schema).__name__}"
                )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string: with kind, the key of its compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, list):
            return msgspec.json.encode(value).decode()
        return "" if value is True else value
