"""The engine side of structured outputs: requests wait for their grammar off the step's
path, then each holds a matcher (RequestGrammar) that its sampled tokens advance, and
each step that samples for such requests carries their bitmask (GrammarOutput).

A request whose grammar is compiling is in none of the scheduler's queues: it holds no
other request back, and enters the waiting queue once its grammar is ready (or fails
with the compile's error). Its matcher only ever advances with tokens that come back
from the workers (the request's output tokens, RequestGrammar): a request recomputed
after preemption samples past the tokens its matcher has, never over them again.

A step's bitmask is filled off the engine's thread (fill): its requests' matchers take
the tokens they lack, one batch per token, then xgrammar fills every row in one call
with threads of its own (no GIL between them), while the engine goes on with the
outputs of the step just applied. A request whose grammar refuses its token fails
alone (its own bad_words can leave no allowed token a finite logit): the others run on.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import numpy as np

from messages import GrammarOutput
from zmqworker.cdiv import cdiv
from zmqworker.engine.grammar_compiler import GrammarCompiler
from zmqworker.engine.request import FinishReason, Request
from zmqworker.engine.request_grammar import RequestGrammar, rejected

# xgrammar's threads for a step's bitmask rows, one for each MIN_ROWS_PER_THREAD rows:
# past 8 they stop paying on a 16-core host.
BITMASK_THREADS = min(8, len(os.sched_getaffinity(0)))
MIN_ROWS_PER_THREAD = 16


class Filled(NamedTuple):
    """A step's bitmask (None: no request left to constrain), and the requests whose
    grammar refused a token they sampled, with why (rejected()): each is to fail alone."""

    output: GrammarOutput | None
    refused: dict[str, str]


class StructuredOutputs:
    """Requests waiting for their grammar, and the bitmask of a step's requests."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._compiling: dict[str, tuple[Request, Future[Any]]] = {}
        # xgrammar's batch fillers by thread count, made with the first bitmask: importing
        # xgrammar takes seconds, which an engine core that never sees a constraint
        # should not pay.
        self._fillers: dict[int, Any] = {}
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        self._bitmasks: dict[int, np.ndarray] = {}  # by slot (fill), grown as needed

    def __len__(self) -> int:
        return len(self._compiling)

    def add(self, request: Request) -> None:
        """Start compiling the grammar of request (which must have structured_outputs)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            raise ValueError(f"request {request.req_id!r} has no structured_outputs")
        if request.req_id in self._compiling:
            raise ValueError(f"request id {request.req_id!r} is already waiting for its grammar")
        self._compiling[request.req_id] = (request, self.compiler.compile(params))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._compiling

    def abort_all(self) -> list[Request]:
        """Abort every request waiting for its grammar (finished, and dropped here)."""
        requests = [request for request, _ in self._compiling.values()]
        self._compiling.clear()
        for request in requests:
            request.finish(FinishReason.ABORT)
        return requests

    def abort(self, req_id: str) -> Request | None:
        """Drop a request still waiting for its grammar; None if it is not waiting."""
        entry = self._compiling.pop(req_id, None)
        return None if entry is None else entry[0]

    def take_ready(self, timeout: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose grammar is ready, with their matchers, in arrival order, and
        those whose grammar failed with the reason; waits up to timeout for one."""
        if timeout > 0 and self._compiling:
            futures = [f for _, f in self._compiling.values()]
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for req_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[req_id]
            exc = future.exception()
            if exc is not None:
                failed.append((request, str(exc) if isinstance(exc, ValueError) else repr(exc)))
                continue
            grammar = RequestGrammar(
                future.result(), request.eos_token_list, request.num_prompt_tokens
            )
            request.grammar = grammar
            ready.append(request)
        return ready, failed

    def fill(self, requests: list[Request], slot: int) -> Future[Filled]:
        """Start filling the bitmask rows of the requests a step samples for, their
        matchers first taking the tokens they lack; no GrammarOutput if none is left to
        constrain (finished ones are skipped: the step's token for them is dropped).
        Until the future is done, nothing else may advance these requests' matchers;
        their tokens are read now. The rows are slot's array, kept for the next fill of
        that slot: the caller fills a slot again only once the workers are done with its
        last bitmask."""
        live = [r for r in requests if not r.is_finished and r.grammar is not None]
        grammars = [r.grammar for r in live if r.grammar is not None]
        lacking = []
        for request, grammar in zip(live, grammars, strict=True):
            lacking.append(request.all_token_ids[grammar.num_accepted :])
            grammar.num_accepted = request.num_tokens
        if not live:
            done: Future[Filled] = Future()
            done.set_result(Filled(None, {}))
            return done
        handles = np.array([r.handle for r in live], np.int32)
        names = [r.req_id for r in live]
        words = cdiv(grammars[0].vocab_size, 32)
        bitmask = self._bitmasks.get(slot)
        if bitmask is None or len(bitmask) < len(live) or bitmask.shape[1] != words:
            bitmask = self._bitmasks[slot] = np.zeros((len(live), words), np.int32)
        return self._filler.submit(self._fill, grammars, lacking, handles, bitmask, names)

    def _fill(
        self,
        grammars: list[RequestGrammar],
        lacking: list[list[int]],
        handles: np.ndarray,
        bitmask: np.ndarray,
        names: list[str],
    ) -> Filled:
        """The matchers take the tokens they lack, one batch per token, then every row
        is filled in one call; a request whose grammar refuses a token has no row."""
        import xgrammar as xgr

        threads = max(1, min(BITMASK_THREADS, len(grammars) // MIN_ROWS_PER_THREAD))
        filler = self._fillers.get(threads)
        if filler is None:
            filler = self._fillers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        matchers = [g.matcher for g in grammars]
        refused: dict[str, str] = {}
        for k in range(max(map(len, lacking))):
            rows = [i for i, t in enumerate(lacking) if len(t) > k and names[i] not in refused]
            if not rows:
                break  # the rest lack more only where refused already
            tokens = [lacking[i][k] for i in rows]
            batch = matchers if len(rows) == len(matchers) else [matchers[i] for i in rows]
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(batch, tokens)
            for row, token, ok in zip(rows, tokens, accepted, strict=True):
                if not ok:
                    refused[names[row]] = rejected(names[row], token)
        kept = [i for i, name in enumerate(names) if name not in refused]
        if not kept:
            return Filled(None, refused)
        rows_out = bitmask[: len(kept)]  # xgrammar writes every word of a row it fills
        filler.batch_fill_next_token_bitmask([matchers[i] for i in kept], rows_out)
        return Filled(GrammarOutput(handles[kept], rows_out), refused)

    def shutdown(self) -> None:
        self._filler.shutdown(wait=True, cancel_futures=True)
        self.compiler.shutdown()
