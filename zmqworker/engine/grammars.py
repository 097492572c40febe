"""StructuredOutputsParams into xgrammar grammars: parsed (which checks them, without a
tokenizer, in about a millisecond) wherever a request comes in, compiled against the
model's tokenizer by the engine core (engine/grammar_compiler.py).

xgrammar was chosen over llguidance by bench/grammar_libraries.py: its compiled grammar
precomputes the token masks, so that advancing a matcher and filling its bitmask row, the
part the engine pays every step, costs a fraction of llguidance's.

JSON is generated compact (no whitespace between tokens): a small model given the
freedom of any whitespace may spend its whole max_tokens on it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from messages import StructuredOutputsParams

_SEPARATORS = (",", ":")
# Constraints checked lately, and xgrammar's complaint (None: valid), most recent last.
_CHECKED: OrderedDict[tuple[str, str], str | None] = OrderedDict()
_MAX_CHECKED = 256


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise the ValueError parse_grammar would; a constraint seen lately is not parsed
    again (a client sends the same schema with every request)."""
    key = (params.kind, params.spec)
    if key not in _CHECKED:
        try:
            parse_grammar(params)
            _CHECKED[key] = None
        except ValueError as exc:
            _CHECKED[key] = str(exc)
        if len(_CHECKED) > _MAX_CHECKED:
            _CHECKED.popitem(last=False)
    _CHECKED.move_to_end(key)
    if (error := _CHECKED[key]) is not None:
        raise ValueError(error)


def parse_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar Grammar of params; a ValueError that names the kind and what xgrammar
    found wrong."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                params.json, any_whitespace=False, separators=_SEPARATORS, strict_mode=True
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=_SEPARATORS
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            # Unescaped non-ASCII: xgrammar reads a JSON \ud83d\ude00 pair as two lone
            # surrogates, which no UTF-8 text matches.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except RuntimeError as exc:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    head, sep, tail = text.partition(": ")
    return tail if sep and head.startswith("[") and ".cc:" in head else text
