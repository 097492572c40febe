"""Incremental detokenization: the text of each new token, as the tokens arrive.

tokenizers' DecodeStream does the streaming: it decodes a window of recent tokens with
and without the new one and emits the difference, holding text back while it ends in an
incomplete character. What it leaves to us: its context (the prompt's last tokens, so the
first output token is decoded as it continues the prompt; never ending in byte-fallback
tokens, skipped special tokens or an incomplete character, which the output's first
tokens could change: the stream would then emit the context's text, or fail on it);
sentencepiece byte-fallback tokens (<0xNN>) and skipped special tokens, which we hold
until another token follows and then step as one run (the decoder turns a whole run of
byte tokens into U+FFFDs when any byte of it is invalid, even bytes that were valid on
their own); and the end of a request, when held tokens must come out, incomplete
characters as U+FFFD, as decode gives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

# Prompt tokens kept as context for the first output token's text.
CONTEXT_TOKENS = 6


def backend_tokenizer(tokenizer: Any) -> Any:
    """The tokenizers.Tokenizer behind a transformers tokenizer (or the object itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch"):
        backend = tokenizer
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no tokenizers backend: streaming text needs a "
            "fast tokenizer (a tokenizer.json in the model folder)"
        )
    return backend


class IncrementalDetokenizer:
    """Text of one request's output tokens, piece by piece.

    The concatenation of everything add() and flush() return equals the tokenizer's
    decode of the output tokens, continuing the prompt's text when prompt ids are given.
    tokenizer is a transformers fast tokenizer or a tokenizers.Tokenizer.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        added = self._backend.get_added_tokens_decoder()
        self._skipped = (
            frozenset(i for i, t in added.items() if t.special)
            if skip_special_tokens
            else frozenset()
        )
        context = self._context(prompt_token_ids)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The tokens of the last emitted piece (the context of held tokens); tokens the
        # stream holds; and tokens not given to the stream yet (a run of byte tokens).
        self._emitted = context
        self._held: list[int] = []
        self._unstepped: list[int] = []

    def add(self, token_id: int) -> str:
        """The new text that token_id completes ("" while a character is incomplete)."""
        token_id = int(token_id)
        self._held.append(token_id)
        if token_id in self._skipped or _is_byte_token(self._backend.id_to_token(token_id)):
            self._unstepped.append(token_id)
            return ""
        piece = self._stream.step(self._backend, [*self._unstepped, token_id])
        self._unstepped = []
        if piece is None:
            return ""
        self._emitted, self._held = self._held[-CONTEXT_TOKENS:], []
        return piece

    def flush(self) -> str:
        """The text of tokens still held back, incomplete characters as U+FFFD."""
        if not self._held:
            return ""
        before = self._decode(self._emitted)
        after = self._decode(self._emitted + self._held)
        self._emitted, self._held = (self._emitted + self._held)[-CONTEXT_TOKENS:], []
        self._unstepped = []
        self._stream = DecodeStream(
            ids=self._emitted, skip_special_tokens=self._skip_special_tokens
        )
        return after[len(before) :]

    def add_all(self, token_ids: Sequence[int]) -> str:
        """The text of these tokens as the request ends, in one decode: what add() of
        each and flush() would give together (incomplete characters as U+FFFD)."""
        self._held += [int(t) for t in token_ids]
        return self.flush()

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text decoded alone, special tokens included (for logprobs)."""
        return self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's last tokens whose text no output token can change: those before
        its trailing byte tokens and skipped special tokens (a run of byte tokens decodes
        as a whole), and before a last character that is incomplete or invalid; none
        when a few tokens more do not find one."""
        end = len(prompt)
        while end and (
            int(prompt[end - 1]) in self._skipped
            or _is_byte_token(self._backend.id_to_token(int(prompt[end - 1])))
        ):
            end -= 1
        for _ in range(CONTEXT_TOKENS):
            context = [int(t) for t in prompt[max(0, end - CONTEXT_TOKENS) : end]]
            if not self._decode(context).endswith("\ufffd"):
                return context
            end -= 1
        return []

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _is_byte_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[5] == ">"
