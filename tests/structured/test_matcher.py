"""Constraints, the grammar compiler's cache, and matcher semantics (EOS, refusals, rebuild, rollback)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from orca_jax.structured import Constraint, ConstraintKind, GrammarCompiler, JsonOptions
from orca_jax.structured.bitmask import allocate_token_bitmask, allowed_token_ids
from orca_jax.tokenizer import ByteTokenizer
from tests.helpers.structured import random_walk, smollm2_tokenizer, walk_weights

BYTES_VOCAB = 1000  # a random-weight preset's logits are wider than its 256 byte ids
BYTES_EOS = 999


@pytest.fixture(scope="module")
def byte_compiler():
    return GrammarCompiler(ByteTokenizer(eos_token_ids=(BYTES_EOS,)), BYTES_VOCAB)


@pytest.fixture(scope="module")
def smol():
    tokenizer = smollm2_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("kind, spec, message", [
    (ConstraintKind.REGEX, "a(b", "unclosed group"),
    (ConstraintKind.GRAMMAR, "start: missing_rule", "unknown name"),
    (ConstraintKind.GRAMMAR, 'root ::= "a" | b', "Rule 'b' not found"),
    (ConstraintKind.JSON_SCHEMA, '{"type": "strange"}', "Invalid type"),
    (ConstraintKind.JSON_SCHEMA, "{not json", "not valid JSON"),
    (ConstraintKind.JSON_SCHEMA, "[1, 2]", "object or a boolean"),
    (ConstraintKind.JSON_SCHEMA, '{"type": "object", "propertyNames": {"maxLength": 3}}', "propertyNames"),
    (ConstraintKind.CHOICE, (), "at least one"),
    (ConstraintKind.CHOICE, "yes", "list of strings"),
    (ConstraintKind.REGEX, 5, "must be a string"),
])
def test_bad_constraints_raise_value_error(kind, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Constraint(kind, spec)


def test_constraints_are_canonical_cache_keys():
    a = Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = Constraint.json_schema('{"type":"object","properties":{"b":{},"a":{}}}')
    assert a == b and hash(a) == hash(b)
    assert Constraint(ConstraintKind.CHOICE, ["x", "y"]) == Constraint("choice", ("x", "y"))
    assert a != Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}},
                                       JsonOptions(any_whitespace=False))
    with pytest.raises(ValueError):
        Constraint.json_schema([1])


def test_compiled_grammars_are_cached_lru():
    compiler = GrammarCompiler(ByteTokenizer(eos_token_ids=(BYTES_EOS,)), BYTES_VOCAB, max_cached_grammars=2)
    c1, c2, c3 = (Constraint(ConstraintKind.REGEX, r) for r in ("a+", "b+", "c+"))
    compiler.matcher(c1), compiler.matcher(c1), compiler.matcher(Constraint(ConstraintKind.REGEX, "a+"))
    assert compiler.num_compiled == 1
    compiler.matcher(c2), compiler.matcher(c1)  # c1 is now the most recent
    compiler.matcher(c3)  # evicts c2
    assert compiler.num_compiled == 3
    compiler.matcher(c1)
    assert compiler.num_compiled == 3
    compiler.matcher(c2)
    assert compiler.num_compiled == 4
    with pytest.raises(ValueError):
        GrammarCompiler(ByteTokenizer(eos_token_ids=(1,)), 300, max_cached_grammars=0)


def test_matchers_of_one_grammar_are_independent(byte_compiler):
    constraint = Constraint(ConstraintKind.CHOICE, ["ab", "ac"])
    first, second = byte_compiler.matcher(constraint), byte_compiler.matcher(constraint)
    assert first.accept(ord("a")) and first.accept(ord("b"))
    row = np.empty(byte_compiler.bitmask_width, np.int32)
    second.fill_bitmask(row)
    assert allowed_token_ids(row, BYTES_VOCAB).tolist() == [ord("a")]


def test_eos_only_where_the_grammar_may_end(byte_compiler):
    matcher = byte_compiler.matcher(Constraint(ConstraintKind.REGEX, "ab?"))
    row = np.empty(byte_compiler.bitmask_width, np.int32)
    assert not matcher.accept(BYTES_EOS)  # cannot end before "a"; the refusal changes nothing
    matcher.fill_bitmask(row)
    assert allowed_token_ids(row, BYTES_VOCAB).tolist() == [ord("a")]
    assert matcher.accept(ord("a")) and matcher.is_accepting() and not matcher.is_terminated()
    matcher.fill_bitmask(row)
    assert allowed_token_ids(row, BYTES_VOCAB).tolist() == [ord("b"), BYTES_EOS]
    assert not matcher.accept(ord("c")) and not matcher.accept(-1) and not matcher.accept(BYTES_VOCAB)
    assert matcher.accept(ord("b")) and matcher.is_terminated()  # nothing but EOS can follow
    matcher.fill_bitmask(row)
    assert allowed_token_ids(row, BYTES_VOCAB).tolist() == [BYTES_EOS]
    assert matcher.accept(BYTES_EOS) and matcher.num_tokens == 3 and matcher.error == ""


def test_byteless_and_special_ids_are_never_allowed(byte_compiler, smol):
    # Ids 256..998 of the byte vocabulary have no bytes; a free-text grammar still never allows them.
    matcher = byte_compiler.matcher(Constraint(ConstraintKind.REGEX, "(.|\n)*"))
    row = np.empty(byte_compiler.bitmask_width, np.int32)
    matcher.fill_bitmask(row)
    allowed = allowed_token_ids(row, BYTES_VOCAB)
    assert allowed.max() == BYTES_EOS and not np.any((allowed >= 256) & (allowed < BYTES_EOS))
    # SmolLM2's control tokens never match their text; its padding past the vocabulary never matches.
    tokenizer, _ = smol
    padded = GrammarCompiler(tokenizer, tokenizer.vocab_size + 64)
    matcher = padded.matcher(Constraint(ConstraintKind.REGEX, "(.|\n)*"))
    row = np.empty(padded.bitmask_width, np.int32)
    matcher.fill_bitmask(row)
    allowed = set(allowed_token_ids(row, padded.vocab_size).tolist())
    specials = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
    assert allowed & specials == set(tokenizer.eos_token_ids)
    assert max(allowed) < tokenizer.vocab_size
    im_start = tokenizer.encode("<|im_start|>")
    assert len(im_start) == 1 and im_start[0] not in allowed


def test_choice_strings_with_escapes(smol):
    tokenizer, compiler = smol
    choices = ['say "hi"', "two\nlines", "back\\slash", "ünïcode ✓", "tab\there"]
    constraint = Constraint(ConstraintKind.CHOICE, choices)
    for choice in choices:
        matcher = compiler.matcher(constraint)
        assert matcher.accept_tokens(tokenizer.encode(choice)) == len(tokenizer.encode(choice))
        assert matcher.is_terminated(), choice
    assert not compiler.matcher(constraint).accept_tokens(tokenizer.encode("say hi")) == len(
        tokenizer.encode("say hi"))


def test_rebuild_from_tokens_equals_incremental_state(smol):
    tokenizer, compiler = smol
    constraint = Constraint.json_schema({
        "type": "object", "required": ["items", "total"], "properties": {
            "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "required": ["name", "qty"],
                                                                "properties": {"name": {"type": "string"},
                                                                               "qty": {"type": "integer"}}}},
            "total": {"type": "number"}}})
    rows: list[np.ndarray] = []
    matcher = compiler.matcher(constraint)
    ids, ended = random_walk(matcher, np.random.default_rng(3), walk_weights(tokenizer), record=rows)
    assert ended and len(ids) > 10
    row = np.empty(compiler.bitmask_width, np.int32)
    for cut in sorted({0, 1, 2, len(ids) // 3, len(ids) // 2, len(ids) - 1, len(ids)}):
        rebuilt = compiler.matcher(constraint, ids[:cut])  # preemption: a fresh matcher replays
        rebuilt.fill_bitmask(row)
        np.testing.assert_array_equal(row, rows[cut])
        assert rebuilt.num_tokens == cut
        matcher.rebuild(ids[:cut])  # or the same matcher, reset
        matcher.fill_bitmask(row)
        np.testing.assert_array_equal(row, rows[cut])
    assert compiler.matcher(constraint, ids).is_terminated()
    # Rolling back k tokens is the state before them.
    matcher.rebuild(ids)
    matcher.rollback(5)
    matcher.fill_bitmask(row)
    np.testing.assert_array_equal(row, rows[len(ids) - 5])
    with pytest.raises(ValueError, match="does not match"):
        compiler.matcher(constraint, tokenizer.encode('{"total": 1}x'))
    assert not matcher.rebuild(tokenizer.encode("nope"))


def test_fill_bitmasks_in_parallel_equals_one_by_one(smol):
    tokenizer, compiler = smol
    constraints = [Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
                   Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]+"),
                   Constraint(ConstraintKind.CHOICE, ["left", "right"]),
                   Constraint(ConstraintKind.JSON_OBJECT)]
    prefixes = ['{"a": 1', "123-", "ri", '{"x": [tr']
    matchers = [compiler.matcher(c, tokenizer.encode(p)) for c, p in zip(constraints, prefixes)]
    bitmask = allocate_token_bitmask(6, compiler.vocab_size)
    compiler.fill_bitmasks([(m, index + 2) for index, m in enumerate(matchers)], bitmask)
    assert (bitmask[:2] == -1).all()  # rows without a matcher are left allowing everything
    row = np.empty(compiler.bitmask_width, np.int32)
    for index, matcher in enumerate(matchers):
        matcher.fill_bitmask(row)
        np.testing.assert_array_equal(bitmask[index + 2], row)
    with pytest.raises(ValueError):
        compiler.fill_bitmasks([(matchers[0], 6)], bitmask)
    with pytest.raises(ValueError):
        compiler.fill_bitmasks([(matchers[0], 0)], np.zeros((1, 5), np.int32))


def test_compact_json_has_fixed_separators(smol):
    tokenizer, compiler = smol
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}
    compact = Constraint.json_schema(schema, JsonOptions(any_whitespace=False))
    free = Constraint.json_schema(schema)
    spaced = '{\n  "a" : 1,\n  "b": true\n}'
    assert compiler.matcher(free).accept_tokens(tokenizer.encode(spaced)) == len(tokenizer.encode(spaced))
    assert compiler.matcher(compact).accept_tokens(tokenizer.encode(spaced)) < len(tokenizer.encode(spaced))
    text = '{"a": 1, "b": true}'
    assert compiler.matcher(compact, tokenizer.encode(text)).is_terminated()


def test_grammar_needs_a_token_the_tokenizer_has(byte_compiler):
    with pytest.raises(ValueError, match="for this tokenizer"):
        byte_compiler.compile(Constraint(ConstraintKind.GRAMMAR, 'start: <[5000]> "x"'))


def test_tokenizer_without_eos_is_refused():
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(ByteTokenizer(), 256)
