"""What a request's output-shaping fields become: the Constraint its output must match, and how
tool calls are read back out of its text.

A Constraint is not built here, on the event loop: the grammar library validates one as it is made,
and some grammars crash or stall it. These functions only check the fields and say how to build it
(a ConstraintRequest); the server builds it in a grammar worker first, then on a front-end thread
(server/preprocess.py).

- response_format json_object / json_schema, structured_outputs and the guided_* fields: a
  Constraint (at most one of them per request);
- tools with tool_choice "auto" (the default with tools, as OpenAI's): no constraint; the parser
  of `--tool-call-parser` (else the one the chat template's markers name, else hermes) reads calls
  out of the model's own format (refused only with `--no-enable-auto-tool-choice`);
- "required" or a named function: a grammar in that parser's format, so the output is calls the
  same parser reads back (structured/tool_grammar.py);
- "none", or no tools: plain text.
Every refusal is an APIError 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import functools

from orca_jax.server.errors import APIError
from orca_jax.server.protocol import ChatCompletionRequest, CompletionRequest
from orca_jax.structured.constraint import ConstraintKind, JsonOptions
from orca_jax.structured.sandbox import (ConstraintBuild, json_schema_constraint, kind_constraint,
                                         tool_calls_constraint)
from orca_jax.structured.tool_parsers import ToolParser, get_tool_parser
from orca_jax.structured.tool_prompt import DEFAULT_FORMAT, tool_call_format_of

INVALID = "invalid_structured_output"  # the code of every refusal of an output constraint
AUTO_TOOL_CHOICE_DISABLED = "auto_tool_choice_disabled"


@dataclasses.dataclass(frozen=True, slots=True)
class ConstraintRequest:
    """A request's output constraint, not built yet."""

    param: str  # the body field it comes from, named in a refusal
    build: ConstraintBuild  # picklable: build(tokenizer) -> Constraint


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallSettings:
    """The server's `--tool-call-parser` and `--enable-auto-tool-choice`."""

    parser: str | None = None  # hermes, llama3_json or mistral; None: the chat template's (for_template)
    enable_auto_tool_choice: bool = True

    def __post_init__(self):
        if self.parser is not None:
            get_tool_parser(self.parser)  # ValueError naming the known parsers

    @property
    def call_format(self) -> str:
        return self.parser or DEFAULT_FORMAT

    def for_template(self, template: str | None) -> ToolCallSettings:
        """These settings with the parser the chat template's markers name when none was given."""
        return dataclasses.replace(self, parser=self.parser or tool_call_format_of(template))


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request's tool calls come out of its choices' text."""

    parser: ToolParser
    # A named function was forced: OpenAI and vLLM then keep finish_reason "stop"; otherwise a
    # choice that called tools finishes with "tool_calls".
    named: bool
    # The parser needs special tokens in the text (llama3_json's <|python_tag|>, mistral's [TOOL_CALLS]).
    needs_special_tokens: bool

    def finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        if num_calls and finish_reason == "stop" and not self.named:
            return "tool_calls"
        return finish_reason


def output_constraint(body: CompletionRequest | ChatCompletionRequest) -> ConstraintRequest | None:
    """The constraint of response_format, structured_outputs or a guided_* field, or None."""
    given = body.structured_fields_given()
    if len(given) > 1:
        raise APIError(400, f"give at most one of response_format, structured_outputs and the guided_* "
                       f"fields; this request gives {', '.join(given)}", param=given[1], code=INVALID)
    if not given:
        return None
    return ConstraintRequest(given[0], _build_of(body, given[0]))


def _build_of(body: CompletionRequest | ChatCompletionRequest, field: str) -> ConstraintBuild:
    plain = JsonOptions()
    if field == "response_format":
        response_format = body.response_format
        if response_format.type == "json_object":
            return functools.partial(kind_constraint, ConstraintKind.JSON_OBJECT, "", plain)
        schema = response_format.json_schema.schema_
        return functools.partial(json_schema_constraint, {} if schema is None else schema, plain)  # {}: any JSON
    if field == "structured_outputs":
        spec = body.structured_outputs
        options = JsonOptions(any_whitespace=not spec.disable_any_whitespace)
        kind = spec.kinds_given[0]
        if kind == "json":
            return functools.partial(json_schema_constraint, spec.json_, options)
        if kind == "json_object":
            return functools.partial(kind_constraint, ConstraintKind.JSON_OBJECT, "", options)
        return functools.partial(kind_constraint, ConstraintKind(kind), getattr(spec, kind), plain)
    if field == "guided_json":
        return functools.partial(json_schema_constraint, body.guided_json, plain)
    kind = {"guided_regex": ConstraintKind.REGEX, "guided_choice": ConstraintKind.CHOICE,
            "guided_grammar": ConstraintKind.GRAMMAR}[field]
    return functools.partial(kind_constraint, kind, getattr(body, field), plain)


def tool_choice_of(body: ChatCompletionRequest):
    """The request's tool_choice, or OpenAI's default: "auto" with tools, else "none"."""
    return body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")


def tool_plan(body: ChatCompletionRequest, settings: ToolCallSettings) -> tuple[ToolPlan | None, ConstraintRequest | None]:
    """(how to read tool calls back, the grammar that forces them) of a chat request; (None, None)
    when its output is plain text."""
    tools = body.tools or []
    choice = tool_choice_of(body)
    if choice == "none" or (choice == "auto" and not tools):
        return None, None
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice (the default with tools) is off on this server '
                           '(--no-enable-auto-tool-choice); send tool_choice "none", "required" or a named '
                           'function', param="tool_choice", code=AUTO_TOOL_CHOICE_DISABLED)
        return _plan(settings.call_format, named=False), None
    if not tools:
        raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice",
                       code=INVALID)
    named = not isinstance(choice, str)
    if named and choice.function.name not in {tool.function.name for tool in tools}:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                       f"the tools ({', '.join(tool.function.name for tool in tools)})",
                       param="tool_choice", code=INVALID)
    build = functools.partial(tool_calls_constraint, [tool.model_dump(by_alias=True) for tool in tools],
                              choice.model_dump() if named else choice, settings.call_format,
                              body.parallel_tool_calls is not False)
    return _plan(settings.call_format, named=named), ConstraintRequest("tools", build)


def _plan(parser: str, *, named: bool) -> ToolPlan:
    return ToolPlan(get_tool_parser(parser), named=named, needs_special_tokens=parser != "hermes")
