"""Request fields that shape the output: response_format, structured_outputs, tools and tool_choice.

OpenAI's `response_format` ({text}, {json_object}, {json_schema: {name, schema, strict}}) and
`tools` / `tool_choice`, and vLLM's `structured_outputs` ({json | regex | choice | grammar |
json_object}, exactly one). What they become (a Constraint, a tool-call plan) is decided in
server/structured.py; here they are only bodies.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from orca_jax.server.protocol_base import StrictBody

JsonSchema = dict | bool  # a JSON schema; true and false are schemas too


class TextFormat(StrictBody):
    type: Literal["text"]


class JsonObjectFormat(StrictBody):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictBody):
    name: str
    description: str | None = None
    # None (no schema given): any JSON value. `schema` itself would shadow BaseModel.schema.
    schema_: JsonSchema | None = Field(None, alias="schema")
    # OpenAI's promise that the output follows the schema exactly. The grammar enforces the schema
    # whether this is true or not (as vLLM does).
    strict: bool | None = None


class JsonSchemaFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: object) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"ResponseFormat[{kind}]" if kind in ("text", "json_object", "json_schema") else None


# Tagged by `type`, so a mistake is reported against the format named, not against all three. The
# tags hold "[" so that error locations skip them (errors._is_union_tag).
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("ResponseFormat[text]")]
    | Annotated[JsonObjectFormat, Tag("ResponseFormat[json_object]")]
    | Annotated[JsonSchemaFormat, Tag("ResponseFormat[json_schema]")],
    Discriminator(_format_type, custom_error_type="invalid_response_format",
                  custom_error_message="type must be 'text', 'json_object' or 'json_schema'")]

# structured_outputs' kinds, each a field of its own; a request gives exactly one.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(StrictBody):
    """vLLM's structured_outputs: exactly one of its kinds is given (not null)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": [kind], "properties": {kind: {"not": {"type": "null"}}}} for kind in STRUCTURED_KINDS]})

    json_: JsonSchema | str | None = Field(None, alias="json")  # a schema, or a schema as JSON text
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: Literal[True] | None = None
    disable_any_whitespace: bool = False  # JSON as json.dumps writes it, no free whitespace

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if len(self.kinds_given) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)}")
        return self

    @property
    def kinds_given(self) -> list[str]:
        return [kind for kind in STRUCTURED_KINDS if getattr(self, "json_" if kind == "json" else kind) is not None]


class FunctionDefinition(StrictBody):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # the arguments always follow `parameters` when a grammar forces the call


class Tool(StrictBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChosenFunction(StrictBody):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictBody):
    type: Literal["function"] = "function"
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class MessageFunctionCall(StrictBody):
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class MessageToolCall(StrictBody):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall
