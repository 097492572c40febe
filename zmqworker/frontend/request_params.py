"""A request's SamplingParams checked against the run and made ready for the workers:
structured_outputs that parse (engine/grammars.py), logprobs within max_logprobs, stop
strings that are text, the token ids it names within the vocabulary, and bad_words (text)
tokenized into bad_words_token_ids, which is all a worker reads of them (it has no
tokenizer). The text is consumed: the params that come back have no bad_words left, so
that checking them again changes nothing.

A bad word is banned where it would start the text and where it would follow a space, as
vLLM does: its tokens without and with a leading space, the latter kept only when it is
another sequence of the same length (one whose first token differs), since a longer
spaced form bans a different split of the word.

Per prompt (for_prompt), what vLLM resolves against the prompt's length: max_tokens=None
(SamplingParams marks it INT32_MAX) becomes the room the prompt leaves, so that the wire
carries a number.
"""

from __future__ import annotations

from typing import Any

import msgspec

from messages import SamplingParams
from messages.sampling import INT32_MAX, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from zmqworker.engine.grammars import check_grammar
from zmqworker.engine.prompts import check_text
from zmqworker.engine.request_message import check_lists, check_token_ids


def request_params(
    params: SamplingParams, tokenizer: Any, vocab_size: int | None, max_logprobs: int
) -> SamplingParams:
    """params with bad_words' token ids moved into bad_words_token_ids; a ValueError names
    what the run cannot take (max_logprobs -1: no limit; vocab_size None: unknown here,
    the workers check)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
    over = params.logprobs_over(max_logprobs)
    if over is not None:
        raise ValueError(f"{over[0]}={over[1]} is more than max_logprobs={max_logprobs}")
    check_lists(params)
    if params.structured_outputs is not None:
        if tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer, which it lacks")
        check_grammar(params.structured_outputs)
    if params.stop and tokenizer is None:  # they are matched in the detokenized text
        raise ValueError("stop strings need the model's tokenizer, which it lacks")
    for i, stop in enumerate(params.stop):
        check_text(stop, f"stop string {i}")
    for i, word in enumerate(params.bad_words):
        check_text(word, f"bad_words[{i}]")
    if not params.bad_words:
        words = params.bad_words_token_ids
    else:
        if tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer: give bad_words_token_ids")
        words = [*params.bad_words_token_ids, *_tokenize(params.bad_words, tokenizer)]
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(
            f"bad_words make {len(words)} token sequences, more than {MAX_BAD_WORDS} (each "
            "word counts once, or twice when it tokenizes differently after a space)"
        )
    if params.bad_words:
        params = msgspec.structs.replace(params, bad_words=[], bad_words_token_ids=words)
    if vocab_size is not None:
        check_token_ids(params, vocab_size)
    return params


def max_tokens_for(
    max_model_len: int, prompt_len: int, max_tokens: int | None, max_new_tokens: int | None = None
) -> int:
    """vLLM's: max_tokens, else the rest of the context, and at most max_new_tokens where
    given (generation_config.json's, which bounds a server's max_tokens, not an LLM's)."""
    bounds = (max_tokens, max_model_len - prompt_len, max_new_tokens)
    return min(b for b in bounds if b is not None)


def for_prompt(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """params as the wire carries them for a prompt of prompt_len tokens: max_tokens=None
    as the room it leaves (min_tokens past that room cut to it: the context would end the
    request first). A prompt that leaves no room is refused here, before anything is
    sent."""
    if params.max_tokens != INT32_MAX:  # a number given: sent as it is
        return params
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, all of max_model_len={max_model_len}: "
            "max_tokens=None (the rest of the context) leaves no token to generate; shorten "
            "the prompt or raise max_model_len"
        )
    return msgspec.structs.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


def _tokenize(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    sequences = []
    for i, word in enumerate(bad_words):
        text = word.lstrip()
        if not text:
            raise ValueError(f"bad_words[{i}] is only whitespace")
        alone = tokenizer.encode(text, add_special_tokens=False)
        spaced = tokenizer.encode(" " + text, add_special_tokens=False)
        forms = [alone]
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            forms.append(spaced)
        for tokens in forms:
            if not tokens or len(tokens) > MAX_BAD_WORD_TOKENS:
                raise ValueError(
                    f"bad_words[{i}] ({word!r}) is {len(tokens)} tokens: a bad word has 1 to "
                    f"{MAX_BAD_WORD_TOKENS}"
                )
            sequences.append([int(t) for t in tokens])
    return sequences
