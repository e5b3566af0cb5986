"""Whatever path through the mask a sampler takes, the output matches: JSON schemas, regex, choice.

Random walks over SmolLM2's real vocabulary draw only allowed tokens (EOS only where allowed); the
decoded text must json-parse and validate against the schema (jsonschema, an independent
implementation), match the regex (Python's re), or be one of the choices.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from orca_jax.structured import Constraint, ConstraintKind, GrammarCompiler, JsonOptions
from tests.helpers.structured import random_walk, smollm2_tokenizer, walk_weights

ADDRESS = {"type": "object", "required": ["street", "city"], "properties": {
    "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string"}, "address": ADDRESS}, "required": ["name", "address"]}}, "required": ["person"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 6},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": ["S", "M", "L", 42, None]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                      "y": {"type": "number", "exclusiveMinimum": 0},
                                      "n": {"type": "integer", "minimum": 1, "maximum": 999}},
     "required": ["x", "y", "n"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 4}}, "required": ["tags"]},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
     "required": ["kind", "radius"]},
    {"anyOf": [{"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"],
                "additionalProperties": False}]},
    {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                         "label": {"type": "string", "maxLength": 8}},
                        "required": ["value"]}},
     "type": "object", "properties": {"root": {"$ref": "#/$defs/node"},
                                      "leaves": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
     "required": ["root", "leaves"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
     "required": ["code"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "number"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sci-fi"]},
                                                 "maxItems": 3},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"type": "integer"}}, "required": ["d"]}},
        "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "object", "properties": {"id": {"type": "integer"}, "meta": {"type": "object"}},
     "required": ["id", "meta"]},
    {"type": "object", "properties": {"events": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                         "what": {"type": "string"}, "where": ADDRESS},
        "required": ["when", "what"]}}}, "required": ["events"]},
    {"title": "Invoice", "type": "object", "properties": {
        "number": {"title": "Number", "type": "string"},
        "lines": {"title": "Lines", "type": "array", "items": {"$ref": "#/$defs/Line"}, "maxItems": 2},
        "paid": {"title": "Paid", "default": False, "type": "boolean"}},
     "required": ["number", "lines"],
     "$defs": {"Line": {"title": "Line", "type": "object", "properties": {
         "text": {"title": "Text", "type": "string"}, "amount": {"title": "Amount", "type": "number"}},
         "required": ["text", "amount"]}}},
]


@pytest.fixture(scope="module")
def setup():
    tokenizer = smollm2_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size), walk_weights(tokenizer)


def _walk(setup, constraint, seed):
    tokenizer, compiler, weights = setup
    matcher = compiler.matcher(constraint)
    ids, ended = random_walk(matcher, np.random.default_rng(seed), weights)
    assert ended, f"walk {seed} did not end in {len(ids)} steps: {tokenizer.decode(ids)!r}"
    assert matcher.is_terminated()
    return tokenizer.decode(ids)


def test_twenty_schemas():
    assert len(SCHEMAS) == 20
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_walks_validate(setup, index):
    schema = SCHEMAS[index]
    for seed, options in ((0, JsonOptions()), (1, JsonOptions()), (2, JsonOptions(any_whitespace=False))):
        text = _walk(setup, Constraint.json_schema(schema, options), seed)
        jsonschema.validate(json.loads(text), schema)
        if not options.any_whitespace:
            assert text == text.strip() and "\n" not in text.replace("\\n", "")


def test_json_object_walks_parse_to_objects(setup):
    for seed in range(3):
        assert isinstance(json.loads(_walk(setup, Constraint(ConstraintKind.JSON_OBJECT), seed)), dict)


@pytest.mark.parametrize("pattern", [
    r"[0-9]{3}-[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s? (eat|sleep)[.!]",
    r"[a-z][a-z0-9_]{0,15}@example\.(com|org)",
    r"\([0-9]+(, [0-9]+){0,3}\)",  # Rust regex: \d is any Unicode digit
    r"(True|False)",
])
def test_regex_walks_match(setup, pattern):
    for seed in range(4):
        text = _walk(setup, Constraint(ConstraintKind.REGEX, pattern), seed)
        assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_walks_pick_a_choice(setup):
    choices = ["positive", "negative", "neutral", "mixed feelings", "N/A"]
    seen = {_walk(setup, Constraint(ConstraintKind.CHOICE, choices), seed) for seed in range(12)}
    assert seen <= set(choices) and len(seen) >= 3


def test_lark_and_gbnf_grammars(setup):
    lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/'
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'
    for seed in range(3):
        text = _walk(setup, Constraint(ConstraintKind.GRAMMAR, lark), seed)
        assert re.fullmatch(r"[0-9()+*]+", text) and text.count("(") == text.count(")")
        assert re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", _walk(setup, Constraint(ConstraintKind.GRAMMAR, gbnf), seed))
