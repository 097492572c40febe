"""Compiled grammars, made off the engine's step path and kept per constraint.

The engine core loop never compiles: compile() hands back a future at once, from a
thread pool that loads the model's tokenizer (once, on the first constraint) and
compiles each (kind, spec) once; later requests with the same constraint share the
future, done or not. The cache is bounded (least recently asked for goes first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from messages import StructuredOutputsParams
from zmqworker.engine.grammars import parse_grammar

MAX_CACHED_GRAMMARS = 512
# xgrammar's own threads per compile: the machine's cores belong to the workers.
COMPILE_THREADS = 2


class GrammarCompiler:
    """Compiles StructuredOutputsParams against the tokenizer of the model at path, whose
    logits have vocab_size columns (the bitmask's width)."""

    def __init__(self, path: str, vocab_size: int | None) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._compiler: Any = None  # made by the pool's thread, which alone reads it
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Future[Any]:
        """A future of params' xgrammar CompiledGrammar; a bad constraint fails it with
        a ValueError that names what is wrong."""
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        grammar = parse_grammar(params)
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler.compile_grammar(grammar)

    def _make_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"structured outputs need the model's tokenizer, which {self.path} lacks: {exc}"
            ) from None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
