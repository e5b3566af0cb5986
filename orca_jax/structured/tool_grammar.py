"""The grammar that forces tool calls, written in the model's own tool-call format.

OpenAI's `tool_choice`, as vLLM serves it:
- "none": the model must not call a tool. No constraint and no parsing; the text is the content.
- "auto" (the default when tools are given): no constraint; the model decides, and the server's
  parser for its family (`--tool-call-parser`, else the chat template's) finds calls in the text.
  A server started with `--no-enable-auto-tool-choice` refuses "auto".
- "required": one or more calls (exactly one when parallel_tool_calls is false) of any given tool;
- {"type": "function", "function": {"name": N}}: exactly one call of N.

The last two get a grammar constraint whose outputs are exactly the format that family's parser
reads (tool_parsers.py), with each call's arguments valid for the tool's JSON schema (llguidance's
`%json` inside Lark). The arguments follow the schema strictly, as xgrammar's strict mode (vLLM's
default) does: an object schema that does not say `additionalProperties` gets `false`, because
llguidance follows JSON Schema (additional properties allowed) and never makes additional keys
unique, so a small model invents keys and repeats them until max_tokens. A tool with `strict: true`
(OpenAI's structured function calling) may not allow additional properties anywhere. Keys listed
in `properties` come once each, in their order (llguidance's rule). Format markers that are special
tokens of the tokenizer (Mistral's `[TOOL_CALLS]`) are written as that token, so the text must be
detokenized with special tokens kept for the parser to see them.
"""

from __future__ import annotations

import json
from typing import Sequence

from orca_jax.structured.constraint import Constraint, ConstraintKind, JsonOptions
from orca_jax.tokenizer import BaseTokenizer

TOOL_CHOICES_WITHOUT_GRAMMAR = ("none", "auto")


def tool_call_constraint(tools: Sequence[dict], tool_choice: str | dict, parser: str, *,
                         parallel_tool_calls: bool = True, tokenizer: BaseTokenizer | None = None,
                         json_options: JsonOptions = JsonOptions()) -> Constraint | None:
    """The constraint for `tool_choice` over OpenAI-style `tools` in `parser`'s format (hermes,
    llama3_json, mistral), or None for "none" and "auto". ValueError for a choice naming no given
    tool, "required" without tools, or a tool whose parameters are not a valid JSON schema."""
    functions = [_function_of(tool) for tool in tools]
    if isinstance(tool_choice, str):
        if tool_choice in TOOL_CHOICES_WITHOUT_GRAMMAR:
            return None
        if tool_choice != "required":
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                             f"got {tool_choice!r}")
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool")
        chosen, many = functions, parallel_tool_calls
    else:
        name = _named_choice(tool_choice)
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(f['name'] for f in functions) or 'none given'})")
        chosen, many = chosen[:1], False
    try:
        writer = _FORMATS[parser]
    except KeyError:
        raise ValueError(f"no tool-call grammar for parser {parser!r}; choose one of {sorted(_FORMATS)}") from None
    lark = writer(chosen, many, tokenizer, json_options)
    return Constraint(ConstraintKind.GRAMMAR, lark, json_options)


def _hermes(functions, many, tokenizer, json_options) -> str:
    call = " | ".join(f'"<tool_call>\\n" %json {_call_schema(f, "arguments", json_options)} "\\n</tool_call>"'
                      for f in functions)
    return _lark(call, '"\\n"', many)


def _llama3_json(functions, many, tokenizer, json_options) -> str:
    # Llama 3.1's own format for JSON tool calls: {"name": ..., "parameters": ...}, `; ` between calls.
    call = " | ".join(f"%json {_call_schema(f, 'parameters', json_options)}" for f in functions)
    return _lark(call, '"; "', many)


def _mistral(functions, many, tokenizer, json_options) -> str:
    call = " | ".join(f"%json {_call_schema(f, 'arguments', json_options)}" for f in functions)
    more = '(", " call)*' if many else ""
    return f'start: {_marker("[TOOL_CALLS]", tokenizer)} "[" call {more} "]"\ncall: {call}\n'


_FORMATS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def _lark(call: str, separator: str, many: bool) -> str:
    start = f"call ({separator} call)*" if many else "call"
    return f"start: {start}\ncall: {call}\n"


def _call_schema(function: dict, arguments_key: str, json_options: JsonOptions) -> str:
    """A call object's schema: `name` fixed to the function's, then its arguments; nothing else."""
    schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                               arguments_key: function["parameters"]},
              "required": ["name", arguments_key], "additionalProperties": False}
    schema["x-guidance"] = json_options.llguidance_overrides()
    return json.dumps(schema, ensure_ascii=False)


def _marker(text: str, tokenizer: BaseTokenizer | None) -> str:
    """The marker as its special token (`<[id]>`) when the tokenizer has one, else as text."""
    if tokenizer is not None:
        ids = tokenizer.encode(text)
        if len(ids) == 1 and tokenizer.is_special(ids[0]):
            return f"<[{ids[0]}]>"
    return json.dumps(text)


def _function_of(tool: dict) -> dict:
    """{"name", "parameters"} of an OpenAI tool {"type": "function", "function": {...}}."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ValueError(f"tool {function['name']!r}: parameters must be a JSON schema object")
    return {"name": function["name"], "parameters": closed_schema(parameters, strict=function.get("strict") is True,
                                                                  where=function["name"])}


# Keywords whose value is one subschema, a list of them, or a map of names to them. `not` is left
# alone (closing inside it would widen what it excludes), and so is `allOf`: llguidance intersects
# its branches, so closing each would leave only the keys they all list.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "propertyNames", "unevaluatedItems", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema, *, strict: bool = False, where: str = "the tool"):
    """A copy of `schema` whose object schemas without `additionalProperties` get `false`;
    ValueError when `strict` and one allows additional properties."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _ONE_SCHEMA:
        if key in closed:
            closed[key] = closed_schema(closed[key], strict=strict, where=where)
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_schema(item, strict=strict, where=where) for item in closed[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_schema(value, strict=strict, where=where)
                           for name, value in closed[key].items()}
    if isinstance(closed.get("additionalProperties"), dict):
        closed["additionalProperties"] = closed_schema(closed["additionalProperties"], strict=strict, where=where)
    # A key required but not listed would be an additional property, which `false` forbids.
    unlisted = set(closed.get("required") or ()) - set(closed.get("properties") or ())
    if _is_object_schema(closed) and not (unlisted and not strict):
        extra = closed.setdefault("additionalProperties", False)
        if strict and extra is not False:
            raise ValueError(f"tool {where!r} is strict, so its objects may not allow additional properties "
                             f"(additionalProperties must be false, got {json.dumps(extra)})")
    return closed


def _is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and any(key in schema for key in ("properties", "required", "patternProperties")))


def _named_choice(tool_choice) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type", "function") != "function" \
            or not isinstance(function.get("name"), str):
        raise ValueError("a named tool_choice must be {'type': 'function', 'function': {'name': ...}}, "
                         f"got {tool_choice!r}")
    return function["name"]
