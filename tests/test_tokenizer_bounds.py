"""How many tokens a text can have from its length alone: a bound that holds for the tokenizers that
keep every character (none, for those that may drop some), checked against real encodings."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from orca_jax.tokenizer import ByteTokenizer, Tokenizer
from orca_jax.tokenizer_bounds import at_most_one_token_per_byte, max_chars_per_token, max_prompt_chars

from tests.helpers.server import chatml_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog " * 20, "hello world, hello there " * 30,
          "numbers 12345 and 67890 " * 10, "ünïcödé ☃ 日本語 " * 10]


def _trained(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    """A byte-level BPE with real merges (long tokens), trained on CORPUS."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    return Tokenizer(backend, chat_template=None, bos_token_id=None, eos_token_ids=())


def test_the_bounds_of_byte_and_chatml_tokenizers():
    assert max_chars_per_token(ByteTokenizer()) == 1 and at_most_one_token_per_byte(ByteTokenizer())
    assert max_chars_per_token(chatml_tokenizer()) == len("<|im_start|>")
    assert max_prompt_chars(ByteTokenizer(), 512) == 512


@pytest.mark.parametrize("normalizer, pre_tokenizer", [
    (normalizers.Strip(), None), (normalizers.NFC(), None), (normalizers.Replace("  ", " "), None),
    (None, pre_tokenizers.Whitespace()), (None, pre_tokenizers.Split(" ", "removed")),
])
def test_tokenizers_that_may_drop_characters_have_no_bound(normalizer, pre_tokenizer):
    tokenizer = _trained(normalizer, pre_tokenizer)
    assert max_chars_per_token(tokenizer) is None and not at_most_one_token_per_byte(tokenizer)


def test_the_bounds_hold_for_a_trained_bpe():
    tokenizer = _trained(normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]))
    per_token = max_chars_per_token(tokenizer)
    assert per_token is not None and per_token > 4  # merges made long tokens
    plain = _trained()
    assert at_most_one_token_per_byte(plain) and not at_most_one_token_per_byte(tokenizer)  # a normalizer adds
    rng = random.Random(0)
    words = " ".join(CORPUS).split() + ["\n", "  ", "☃☃", "x"]
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 200)))
        assert len(tokenizer.encode(text)) * per_token >= len(text)
        assert len(plain.encode(text)) <= len(text.encode("utf-8"))
