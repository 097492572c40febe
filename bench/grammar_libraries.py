"""xgrammar against llguidance on the embedded model's tokenizer (SmolLM2, 49k tokens),
for the engine's structured outputs: the library that wins here is the one the engine uses.

Two costs matter to the engine:
- compile: a nested JSON schema (objects in objects, arrays, enums, bounded strings)
  turned into what a request's matcher starts from; paid once per schema (cached), off
  the step's path, but a request waits for it;
- step: at batch 64, every matcher advanced by one token and the step's bitmask filled
  (64 rows of ceil(vocab / 32) words): on the engine's turn between two steps.
Each matcher walks the tokens of a valid instance of the schema, the 64 starting at
different offsets so that they are in different states. Writes
bench/results/grammar_libraries.json.

    python -m bench.grammar_libraries [--batch 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import pin_threads, print_table, write_results

MODEL = Path.home() / ".cache" / "zmqworker" / "smollm2-135m-instruct"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"k": {"type": "string", "maxLength": 8}, "v": {"type": "number"}},
                "required": ["k", "v"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags", "scores"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "tags": ["math", "poet"],
    "scores": [{"k": "a", "v": 1.5}, {"k": "b", "v": 2}],
}


def _tokens(tokenizer: Any, eos: int) -> list[int]:
    text = json.dumps(INSTANCE, separators=(",", ":"))
    return [*tokenizer.encode(text, add_special_tokens=False), eos]


def _walk(advance: Any, fill: Any, matchers: list, tokens: list[int], steps: int) -> float:
    """Mean seconds of one step: fill every matcher's bitmask row, then advance each by
    its next token (matcher i walks tokens from offset i)."""
    n = len(tokens) - 1  # the last token (EOS) would end the walk
    start = time.perf_counter()
    for s in range(steps):
        fill(matchers)
        advance(matchers, [tokens[(i + s) % n] for i in range(len(matchers))])
    return (time.perf_counter() - start) / steps


def bench_xgrammar(hf_tokenizer: Any, eos: int, vocab: int, batch: int, repeats: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    schema = json.dumps(SCHEMA)
    compile_s = []
    for _ in range(repeats):  # a fresh compiler each time: its cache would hide the cost
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        compile_s.append(time.perf_counter() - start)
    tokens = _tokens(hf_tokenizer, eos)
    n = len(tokens) - 1
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads=1)

    def fresh() -> list:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        for i, m in enumerate(matchers):
            for t in tokens[: i % n]:
                assert m.accept_token(t)
        return matchers

    def fill(ms: list) -> None:
        batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def advance(ms: list, toks: list[int]) -> None:
        for m, t in zip(ms, toks, strict=True):
            if not m.accept_token(t):
                m.reset()  # walked past the end: start over, as the offsets wrap
                m.accept_token(t)

    step_s = min(_walk(advance, fill, fresh(), tokens, 40) for _ in range(repeats))
    return {"library": "xgrammar", "compile_ms": 1e3 * min(compile_s), "step_us": 1e6 * step_s}


def bench_llguidance(tokenizer_json: str, eos: int, vocab: int, batch: int, repeats: int) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    compile_s = []
    for _ in range(repeats):  # llguidance builds a matcher's lexer when it is made
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_s.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
    from transformers import PreTrainedTokenizerFast

    tokens = _tokens(PreTrainedTokenizerFast(tokenizer_object=_rust(tokenizer_json)), eos)
    n = len(tokens) - 1
    bitmask = llnp.allocate_token_bitmask(batch, vocab)
    executor = llguidance.LLExecutor(1)

    def fresh() -> list:
        matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(batch)]
        for i, m in enumerate(matchers):
            assert m.consume_tokens(tokens[: i % n])
        return matchers

    def fill(ms: list) -> None:
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def advance(ms: list, toks: list[int]) -> None:
        for m, t in zip(ms, toks, strict=True):
            if not m.consume_token(t):
                m.reset()
                m.consume_token(t)

    step_s = min(_walk(advance, fill, fresh(), tokens, 40) for _ in range(repeats))
    return {"library": "llguidance", "compile_ms": 1e3 * min(compile_s), "step_us": 1e6 * step_s}


def _rust(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pin_threads(1)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(MODEL))
    config = json.loads((MODEL / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), int(hf.eos_token_id)
    tokenizer_json = (MODEL / "tokenizer.json").read_text()
    rows = [
        bench_xgrammar(hf, eos, vocab, args.batch, args.repeats),
        bench_llguidance(tokenizer_json, eos, vocab, args.batch, args.repeats),
    ]
    for row in rows:
        row["step_us_per_request"] = row["step_us"] / args.batch
    print_table(rows, precision=1)
    path = write_results(
        "grammar_libraries",
        {"model": MODEL.name, "vocab": vocab, "batch": args.batch, "threads": 1, "rows": rows},
    )
    print(f"wrote {path}; numpy {np.__version__}")


if __name__ == "__main__":
    main()
