"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice or a grammar.

A `Constraint` is checked when it is built, by the grammar library itself (llguidance), so a bad
schema, regex or grammar is a `ValueError` with the library's message before any token is
generated (the server answers it with a 400). Its spec is canonical text, so equal constraints
are equal keys of the compiled-grammar cache.
"""

from __future__ import annotations

import dataclasses
import enum
import json

import llguidance

from orca_jax import json_limits


class ConstraintKind(enum.Enum):
    """vLLM's structured-output kinds; `json_object` is OpenAI's response_format {"type": "json_object"}."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark (llguidance's dialect, %json included) or GBNF/EBNF (`::=` rules)


# What may stand between two JSON tokens with any_whitespace: a few blanks, then at most one line
# break and an indentation (deep enough for pretty-printing ~16 levels of 2-space indents). Bounded,
# so a model cannot loop on whitespace until max_tokens (small models do, with unbounded whitespace).
JSON_WHITESPACE = r"[ \t]{0,8}(\r?\n[ \t]{0,32})?"


@dataclasses.dataclass(frozen=True, slots=True)
class JsonOptions:
    """How JSON is laid out; vLLM's `disable_any_whitespace` is `any_whitespace=False`."""

    # True: JSON whitespace between tokens as models write it (newlines, indentation), within
    # JSON_WHITESPACE per gap; False: exactly `, ` and `: ` between items, as json.dumps writes.
    any_whitespace: bool = True

    def __post_init__(self):
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"JsonOptions.any_whitespace must be a bool, got {self.any_whitespace!r}")

    def llguidance_overrides(self) -> dict:
        if self.any_whitespace:
            return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """One request's output constraint: `kind` and its `spec` (canonical text or a tuple of choices).

    spec by kind: JSON_SCHEMA the schema as JSON text (see `json_schema`); JSON_OBJECT "" (unused);
    REGEX the pattern (Rust regex syntax, anchored at both ends); CHOICE a non-empty tuple of
    strings; GRAMMAR the grammar text.
    """

    kind: ConstraintKind
    spec: str | tuple[str, ...] = ""
    json_options: JsonOptions = JsonOptions()

    def __post_init__(self):
        if not isinstance(self.kind, ConstraintKind):
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        if self.kind is ConstraintKind.CHOICE:
            if isinstance(self.spec, str) or not all(isinstance(c, str) for c in self.spec):
                raise ValueError("a choice constraint needs a list of strings, got "
                                 f"{type(self.spec).__name__}")
            object.__setattr__(self, "spec", tuple(self.spec))
            if not self.spec:
                raise ValueError("a choice constraint needs at least one string")
        elif not isinstance(self.spec, str):
            raise ValueError(f"a {self.kind.value} constraint's spec must be a string, "
                             f"got {type(self.spec).__name__}")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            _check_json_schema_text(self.spec)
        problem = llguidance.LLMatcher.validate_grammar(self.llguidance_grammar())
        if problem:
            raise ValueError(f"invalid {self.kind.value}: {problem.strip()}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, json_options: JsonOptions = JsonOptions()) -> "Constraint":
        """From a schema as a dict (OpenAI's response_format.json_schema.schema) or as JSON text."""
        if isinstance(schema, str):
            schema = _check_json_schema_text(schema)
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        # Key order is kept: it is the order properties are generated in.
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), json_options)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles to."""
        LLMatcher = llguidance.LLMatcher
        overrides = self.json_options.llguidance_overrides()
        if self.kind is ConstraintKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(self.spec, overrides=overrides)
        if self.kind is ConstraintKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=overrides)
        if self.kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind is ConstraintKind.CHOICE:
            # Lark string literals take JSON's escapes; ensure_ascii=False keeps non-ASCII as is.
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.spec))
        try:
            return llguidance.grammar_from("grammar", self.spec)  # GBNF is converted to Lark
        except ValueError as err:
            raise ValueError(f"invalid grammar: {err}") from err


def _check_json_schema_text(text: str):
    # Nesting bounded before parsing: json.loads and the walks after it recurse per level.
    try:
        schema = json_limits.loads(text, "the JSON schema text")
    except json_limits.JSONLimitError as err:
        raise ValueError(f"invalid json_schema: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"invalid json_schema: must be an object or a boolean, got {type(schema).__name__}")
    return schema
