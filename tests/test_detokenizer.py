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


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_any_prompt_streams_the_text_made_at_the_end(tok, skip_special_tokens):
    """Prompts that end mid-character, in byte tokens or special tokens included: the
    pieces add up to add_all's text (no error, none of the prompt's text)."""
    rng = random.Random(1)
    specials = sorted(tok.all_special_ids)
    for _ in range(300):
        ids = [
            rng.choice(specials) if rng.random() < 0.15 else rng.randrange(len(tok))
            for _ in range(rng.randrange(2, 25))
        ]
        cut = rng.randrange(1, len(ids))
        prompt, output = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
        pieces = [detok.add(t) for t in output] + [detok.flush()]
        whole = IncrementalDetokenizer(tok, prompt, skip_special_tokens).add_all(output)
        assert "".join(pieces) == whole, (prompt, output)


def test_a_prompt_cut_inside_a_character_leaves_its_text_out():
    tok = byte_level_tokenizer()
    ids = tok.encode("ab 😀 cd", add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if decode(tok, ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    text = "".join(stream(tok, output, prompt))
    assert "ab" not in text and text.endswith(" cd")
    assert IncrementalDetokenizer(tok, prompt).add_all(output) == text


def test_an_invalid_byte_after_a_prompt_of_byte_tokens_is_its_own_text():
    """A run of byte tokens decodes as a whole: the prompt's "/" (<0x2F>) and an output's
    stray <0x86> would both become U+FFFD, changing the prompt's text under the stream."""
    tok = sentencepiece_tokenizer()
    prompt = tok.convert_tokens_to_ids(["▁Hello", "<0x2F>"])
    output = tok.convert_tokens_to_ids(["<0x86>", "h"])
    assert "".join(stream(tok, output, prompt)) == "\ufffdh"
