"""Our tokenizer as the grammar library sees it: the bytes of every id the model can emit.

Built once per tokenizer (llguidance turns it into a token trie, ~0.1 s for 49k ids, ~0.4 s for
128k). Ids the tokenizer has no bytes for -- the random-weight presets' ids past 256, a model's
padding past the tokenizer's vocabulary -- get empty bytes, which llguidance never allows in a
mask (measured: benchmarks/probes/grammar_choice.json). Special tokens are marked as such, so
their text (`<|im_end|>`) is never produced as a match for the same characters in a grammar; a
grammar names them with llguidance's `<[id]>` syntax instead.
"""

from __future__ import annotations

import llguidance

from orca_jax.tokenizer import BaseTokenizer


class _TokenizerDescription:
    """The duck type llguidance.TokenizerWrapper reads: tokens, special ids, eos/bos, an encoder."""

    def __init__(self, tokenizer: BaseTokenizer, vocab_size: int, eos_token_id: int):
        known = min(tokenizer.vocab_size, vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(known)] + [b""] * (vocab_size - known)
        self.special_token_ids = [i for i in range(known) if tokenizer.is_special(i)]
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        # llguidance tokenizes forced text with it; a cut UTF-8 tail is left to its greedy fallback.
        return self._tokenizer.encode(text.decode("utf-8", errors="ignore"))


def grammar_tokenizer(tokenizer: BaseTokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for masks of `vocab_size` ids (the logits' width, which may differ
    from the tokenizer's own size); every id in `tokenizer.eos_token_ids` ends a grammar."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    eos = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
    if not eos:
        raise ValueError(f"structured outputs need an EOS token id below {vocab_size}; "
                         f"the tokenizer has {tokenizer.eos_token_ids}")
    description = _TokenizerDescription(tokenizer, vocab_size, eos[0])
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(description), eos_token=eos)
