"""How many tokens a text can have, from its length alone, where the tokenizer allows saying so.

A prompt of 1.9 MB takes a real tokenizer seconds to encode, only to be refused for its length. But
no token stands for more than the longest piece of text in the vocabulary, so a text of more than
max_model_len x that many characters cannot fit in any tokenization, and is refused without being
tokenized. That holds only for tokenizers that keep every character of the input: a normalizer or
pre-tokenizer that deletes text (stripping, whitespace splitting, composing accents) could turn many
characters into few tokens; for those max_chars_per_token is None. The other way, a byte-level
tokenizer without a normalizer spells each byte of its input in exactly one token, so a text has at
most as many tokens as UTF-8 bytes: a fine-tuning file's example that short fits without tokenizing.
"""

from __future__ import annotations

import json

from orca_jax.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer

# Normalizers and pre-tokenizers (by their `type`) that never delete input characters: they map,
# split, or add (Prepend; NFD and NFKD only decompose, Lowercase can only lengthen).
_KEEPING_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"})


def _keeps_text(component: dict | None, kind: str) -> bool:
    """Whether a tokenizers normalizer or pre-tokenizer (as its JSON; `kind` "normalizer" or
    "pretokenizer", as a Sequence names its parts) keeps every character."""
    if component is None:
        return True
    name = component.get("type")
    if name == "Sequence":
        return all(_keeps_text(part, kind) for part in component.get(f"{kind}s", ()))
    if kind == "normalizer":
        if name == "Replace":  # a plain string replaced by one at least as long
            pattern = component.get("pattern", {})
            return "String" in pattern and len(component.get("content", "")) >= len(pattern["String"])
        return name in _KEEPING_NORMALIZERS
    if name in ("Split", "Punctuation"):
        return str(component.get("behavior", "")).lower() != "removed"
    return name in _KEEPING_PRE_TOKENIZERS


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def max_chars_per_token(tokenizer: BaseTokenizer) -> int | None:
    """The most input characters one token can stand for, or None when no such bound holds."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1  # a token is a byte; a character is one to four
    if not isinstance(tokenizer, Tokenizer):
        return None
    backend = tokenizer.backend
    if not (_keeps_text(_state(backend.normalizer), "normalizer")
            and _keeps_text(_state(backend.pre_tokenizer), "pretokenizer")):
        return None
    # A token spells its bytes (byte-level) or its text (SentencePiece pieces, "▁" for a space); each
    # byte is at most one character. Added tokens match their content.
    longest = max((max(len(tokenizer.token_bytes(i)), len(tokenizer.id_to_token(i) or ""))
                   for i in range(tokenizer.vocab_size)), default=1)
    return max(1, longest)


def at_most_one_token_per_byte(tokenizer: BaseTokenizer) -> bool:
    """Whether every text encodes (without special tokens) to at most one token per UTF-8 byte: each
    token spells at least one byte, and nothing is added to the text (no normalizer)."""
    if isinstance(tokenizer, ByteTokenizer):
        return True
    return (isinstance(tokenizer, Tokenizer) and tokenizer.backend.normalizer is None
            and max_chars_per_token(tokenizer) is not None
            and all(tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)))


def max_prompt_chars(tokenizer: BaseTokenizer, max_model_len: int) -> int | None:
    """Characters beyond which a text cannot fit max_model_len tokens (None: no bound known)."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else per_token * max_model_len
