"""One request's grammar matcher (xgrammar), which its sampled tokens advance."""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    """One request's matcher over its compiled grammar: the grammar's end is one of its
    stop tokens (the request's EOS ids).

    The matcher takes the request's output tokens in order, lagging behind them: the
    scheduler appends tokens to the request in bulk, and the matchers of a step's
    requests take theirs in one batch when its bitmask is filled (structured_outputs.py);
    a token that may end the grammar (one of its stop tokens) is taken at once
    (catch_up), since it decides whether the request finishes."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], num_accepted: int) -> None:
        """num_accepted: the request's tokens the matcher starts past (its prompt's)."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        # The tokens that end the grammar: xgrammar's defaults where the request has none.
        self.stop_token_ids = frozenset(self._matcher.stop_token_ids)
        # The request's tokens (all_token_ids) the matcher holds; those after it lacks.
        self.num_accepted = num_accepted

    def catch_up(self, req_id: str, token_ids: list[int]) -> str | None:
        """Take token_ids[num_accepted:] (the request's tokens) one by one; why the
        grammar refused one (rejected()), or None when it took them all."""
        for token_id in token_ids[self.num_accepted :]:
            if not self._matcher.accept_token(token_id):
                return rejected(req_id, token_id)
            self.num_accepted += 1
        return None

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted)."""
        return bool(self._matcher.is_terminated())

    @property
    def matcher(self) -> Any:
        return self._matcher


def rejected(req_id: str, token_id: int) -> str:
    """Why a request fails whose sampled token its grammar does not allow. Its own
    settings can cause it (bad_words that ban every token the grammar allows leave no
    logit finite), so it fails that request alone, never the step."""
    return (
        f"request {req_id!r}: token {token_id} breaks its structured_outputs constraint "
        "(its bad_words ban every token the grammar allows, or the workers did not apply "
        "the grammar bitmask)"
    )
