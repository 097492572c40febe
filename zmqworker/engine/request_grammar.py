"""One request's grammar matcher (xgrammar), which its sampled tokens advance."""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    """One request's matcher over its compiled grammar: the grammar's end is one of its
    stop tokens (the request's EOS ids)."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted)."""
        return bool(self._matcher.is_terminated())

    @property
    def matcher(self) -> Any:
        return self._matcher
