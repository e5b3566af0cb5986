"""Forced tool calls: every output of the grammar parses with its family's parser into calls whose
arguments validate against the tool's schema (random walks over SmolLM2's vocabulary)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken

from orca_jax.structured import GrammarCompiler, JsonOptions
from orca_jax.structured.tool_grammar import tool_call_constraint
from orca_jax.structured.tool_parsers import get_tool_parser
from orca_jax.tokenizer import Tokenizer
from tests.helpers.structured import random_walk, smollm2_tokenizer, walk_weights

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query", "filters"], "properties": {
            "query": {"type": "string", "maxLength": 30},
            "filters": {"type": "object", "properties": {"max_results": {"type": "integer", "minimum": 1,
                                                                         "maximum": 10},
                                                         "langs": {"type": "array", "items": {"enum": ["en", "fr"]},
                                                                   "maxItems": 2}}}}}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: {} is its only arguments
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
FAMILIES = ["hermes", "llama3_json", "mistral"]


@pytest.fixture(scope="module")
def smol():
    tokenizer = smollm2_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size), walk_weights(tokenizer)


@pytest.fixture(scope="module")
def mistral_like():
    """SmolLM2 plus a special `[TOOL_CALLS]` token, as Mistral's tokenizers have it."""
    base = smollm2_tokenizer()
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tokenizer = Tokenizer(backend, chat_template=None, bos_token_id=base.bos_token_id,
                          eos_token_ids=base.eos_token_ids)
    weights = np.append(walk_weights(base), 1.0)
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size), weights


def _forced_calls(setup, family, tool_choice, seed, parallel=True, json_options=JsonOptions()):
    tokenizer, compiler, weights = setup
    constraint = tool_call_constraint(TOOLS, tool_choice, family, parallel_tool_calls=parallel,
                                      tokenizer=tokenizer, json_options=json_options)
    matcher = compiler.matcher(constraint)
    ids, ended = random_walk(matcher, np.random.default_rng(seed), weights)
    assert ended, tokenizer.decode(ids)
    # Special tokens kept: a family's marker may be one.
    text = tokenizer.decode(ids, skip_special_tokens=False)
    content, calls = get_tool_parser(family).parse(text)
    assert content is None, text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return text, calls


@pytest.mark.parametrize("family", FAMILIES)
def test_named_function_gives_one_valid_call(smol, family):
    for name in SCHEMAS:
        for seed in range(2):
            _, calls = _forced_calls(smol, family, {"type": "function", "function": {"name": name}}, seed)
            assert [c.name for c in calls] == [name]


@pytest.mark.parametrize("family", FAMILIES)
def test_required_gives_valid_calls(smol, family):
    names, counts = set(), set()
    for seed in range(10):
        _, calls = _forced_calls(smol, family, "required", seed)
        assert calls
        names |= {c.name for c in calls}
        counts.add(len(calls))
    assert len(names) >= 3  # the grammar lets each tool be called
    assert max(counts) > 1  # and several in one answer
    for seed in range(3):
        _, calls = _forced_calls(smol, family, "required", seed, parallel=False,
                                 json_options=JsonOptions(any_whitespace=False))
        assert len(calls) == 1


def test_mistral_marker_is_the_special_token(mistral_like):
    tokenizer, _, _ = mistral_like
    marker_id = tokenizer.encode("[TOOL_CALLS]")
    assert len(marker_id) == 1 and tokenizer.is_special(marker_id[0])
    constraint = tool_call_constraint(TOOLS, "required", "mistral", tokenizer=tokenizer)
    assert f"<[{marker_id[0]}]>" in constraint.spec
    text, calls = _forced_calls(mistral_like, "mistral", "required", 0)
    assert text.startswith("[TOOL_CALLS][") and calls
    # Without the tokenizer the marker is plain text, and it parses the same.
    assert '"[TOOL_CALLS]"' in tool_call_constraint(TOOLS, "required", "mistral").spec


def test_none_and_auto_have_no_grammar():
    for choice in ("none", "auto"):
        assert tool_call_constraint(TOOLS, choice, "hermes") is None
    assert tool_call_constraint([], "auto", "hermes") is None


@pytest.mark.parametrize("tools, choice, parser, message", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "hermes", "not among the tools"),
    ([], "required", "hermes", "at least one tool"),
    (TOOLS, "sometimes", "hermes", "tool_choice must be"),
    (TOOLS, {"type": "function"}, "hermes", "named tool_choice"),
    (TOOLS, "required", "pythonic", "no tool-call grammar"),
    ([{"type": "function"}], "required", "hermes", "each tool must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required", "hermes", "JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}], "required", "hermes",
     "Invalid type"),
])
def test_errors(tools, choice, parser, message):
    with pytest.raises(ValueError, match=message):
        tool_call_constraint(tools, choice, parser)


def _accepts(constraint, text: str) -> bool:
    from orca_jax.tokenizer import ByteTokenizer

    matcher = GrammarCompiler(ByteTokenizer(eos_token_ids=(0,)), 256).matcher(constraint)
    data = text.encode()
    return matcher.accept_tokens(data) == len(data) and matcher.is_accepting()


def _hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


NESTED = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["room"], "properties": {
        "room": {"type": "string"},
        "guest": {"type": "object", "properties": {"name": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}}}}}}


@pytest.mark.parametrize("arguments, accepted", [
    ('{"room": "a"}', True),
    ('{"room": "a", "guest": {"name": "Ada"}, "tags": [{"k": "v"}], "extra": {"n": 1}}', True),
    ('{"room": "a", "room": "b"}', False),  # a listed key twice
    ('{"room": "a", "note": "x"}', False),  # a key the schema does not list (llguidance would allow it)
    ('{"room": "a", "guest": {"name": "Ada", "name": "Bo"}}', False),  # nested objects are closed too
    ('{"room": "a", "guest": {"age": 3}}', False),
    ('{"room": "a", "tags": [{"k": "v", "z": 1}]}', False),  # and objects inside arrays
    ('{"room": "a", "extra": {"n": 1, "m": 2}}', True),  # additionalProperties the schema gives is kept
])
def test_forced_arguments_admit_no_unlisted_or_repeated_keys(arguments, accepted):
    constraint = tool_call_constraint([NESTED], "required", "hermes")
    assert _accepts(constraint, _hermes_call("book", arguments)) is accepted


def test_a_strict_tool_may_not_allow_additional_properties():
    strict = {"type": "function", "function": {**NESTED["function"], "strict": True}}
    with pytest.raises(ValueError, match="strict.*additionalProperties must be false"):
        tool_call_constraint([strict], "required", "hermes")
    del strict["function"]["parameters"]["properties"]["extra"]
    constraint = tool_call_constraint([strict], "required", "hermes")
    assert _accepts(constraint, _hermes_call("book", '{"room": "a", "guest": {"name": "Ada"}}'))
    assert not _accepts(constraint, _hermes_call("book", '{"room": "a", "guest": {"x": 1}}'))
