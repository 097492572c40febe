"""Incremental detokenization equals the tokenizer's decode, piece by piece."""

from __future__ import annotations

import random

import pytest
from engine_helpers import byte_level_tokenizer, sentencepiece_tokenizer

from zmqworker.frontend.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Héllo wörld, naïve café 😀 日本語 ok",
    "Hello world the capital",
]


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, ids, prompt=()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.add(t) for t in ids] + [detok.flush()]


def embedded_tokenizer():
    embedded = pytest.importorskip("zmqworker.models.embedded")
    try:
        path = embedded.default_model_path(progress=False)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"embedded model not available: {exc}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "embedded"])
def tok(request):
    if request.param == "byte_level":
        return byte_level_tokenizer()
    if request.param == "sentencepiece":
        return sentencepiece_tokenizer()
    return embedded_tokenizer()


def test_random_sequences_match_decode(tok):
    """Any ids, special tokens and invalid UTF-8 included: the pieces add up to decode."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 25))]
        assert "".join(stream(tok, ids)) == decode(tok, ids), ids


def test_text_continues_the_prompt(tok):
    for prompt_text in TEXTS:
        for output_text in TEXTS:
            prompt = tok.encode(prompt_text, add_special_tokens=False)
            output = tok.encode(" " + output_text, add_special_tokens=False)
            expected = decode(tok, prompt + output)[len(decode(tok, prompt)) :]
            assert "".join(stream(tok, output, prompt)) == expected


def test_multibyte_character_comes_out_whole_when_complete(tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == "a😀"
    # Bytes of an incomplete emoji never come out as replacement characters.
    assert all("\ufffd" not in piece for piece in pieces)
    assert "😀" in pieces


def test_sentencepiece_keeps_the_space_of_a_word_after_the_prompt():
    tok = sentencepiece_tokenizer()
    prompt, world = tok.encode("Hello", add_special_tokens=False), tok.encode(" world")[-1]
    assert tok.convert_ids_to_tokens(world) == "▁world" and decode(tok, [world]) == "world"
    assert IncrementalDetokenizer(tok, prompt).add(world) == " world"
    # With no prompt, as decode does, the first word has no space.
    assert IncrementalDetokenizer(tok).add(world) == "world"


def test_special_tokens_are_skipped():
    tok = byte_level_tokenizer()
    ids = tok.encode("Hi") + [tok.eos_token_id] + tok.encode(" there")
    assert "".join(stream(tok, ids)) == "Hi there"
