"""Incremental detokenization: the text of each new token, as the tokens arrive.

Decoding one token alone is wrong in two ways: a character may span several tokens
(byte-level BPE and sentencepiece byte fallback split UTF-8 into bytes), and some decoders
change a token's text by its neighbours (sentencepiece drops the space of a leading
"▁"). So each step decodes a short window of recent tokens twice, with and without the
new ones, and emits the difference; while the window ends in an incomplete character
(U+FFFD), nothing is emitted and the window grows. Sentencepiece byte-fallback tokens
(<0xNN>), and skipped special tokens within their runs, are held back until another
token follows: the decoder turns a whole run of byte tokens into U+FFFDs when any byte
of it is invalid, even bytes that were valid on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens kept as context for the first output token's text.
CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output tokens, piece by piece.

    The concatenation of everything add() and flush() return equals the tokenizer's
    decode of the output tokens, continuing the prompt's text when prompt ids are given.
    tokenizer is a transformers tokenizer (anything with a compatible decode()).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Skipped tokens add no text; holding them keeps a byte run they split whole.
        self._skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        start = max(0, len(prompt_token_ids) - CONTEXT_TOKENS)
        self._ids = [int(t) for t in prompt_token_ids[start:]]
        # ids[:read] have had their text emitted; ids[prefix:read] are context for the rest.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None

    def add(self, token_id: int) -> str:
        """The new text that token_id completes ("" while a character is incomplete)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id in self._skipped or _is_byte_token(
            self._tokenizer.convert_ids_to_tokens(token_id)
        ):
            return ""
        prefix_text, full_text = self._texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._advance()
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text of tokens still held back, incomplete characters as U+FFFD."""
        prefix_text, full_text = self._texts()
        self._advance()
        return full_text[len(prefix_text) :]

    def _texts(self) -> tuple[str, str]:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._prefix_text, self._decode(self._ids[self._prefix :])

    def _advance(self) -> None:
        # The emitted tokens become the next window's context; older ones are dropped.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _is_byte_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[5] == ">"
