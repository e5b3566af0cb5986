"""Tools put before the conversation for chat templates that drop them, in a parser's own format.

Some chat templates (SmolLM2's, the default model's) never write `tools` into the prompt, so the
model cannot know them and `tool_choice: "auto"` never calls. For those, the tools go into the
system message as the instructions of the tool-call format the server reads back: hermes as
Qwen2.5's template writes them (`<tools>` signatures, calls as `<tool_call>{"name", "arguments"}`),
llama3_json as Llama 3.1's JSON tool prompt, mistral as a list after `[TOOL_CALLS]`. Such a template
drops an assistant turn's `tool_calls` too: they are written into its content in the same format, and
(hermes) tool results become Qwen2.5's `<tool_response>` user turns. Which format a template uses is
read from the markers it holds (hermes when it holds none).
"""

from __future__ import annotations

import json

HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
LLAMA3_JSON_INSTRUCTIONS = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
    "Do not use variables.\n\n{tools}")
MISTRAL_INSTRUCTIONS = (
    "You can call these functions:\n{tools}\n\n"
    "To call functions, reply with [TOOL_CALLS] and then a JSON list of calls: "
    '[TOOL_CALLS][{{"name": <function-name>, "arguments": <args-json-object>}}]')
_INSTRUCTIONS = {"hermes": (HERMES_INSTRUCTIONS, "\n"), "llama3_json": (LLAMA3_JSON_INSTRUCTIONS, "\n\n"),
                 "mistral": (MISTRAL_INSTRUCTIONS, "\n")}
# A template that writes calls in a format names its marker.
_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))
DEFAULT_FORMAT = "hermes"


def tool_call_format_of(template: str | None) -> str:
    """The tool-call format (a parser's name) a chat template writes calls in; hermes when it shows none."""
    return next((name for marker, name in _MARKERS if template and marker in template), DEFAULT_FORMAT)


def tools_instructions(tools: list[dict], call_format: str) -> str:
    """The system-prompt text that shows `tools` (OpenAI's objects) and how to call them in `call_format`."""
    try:
        text, separator = _INSTRUCTIONS[call_format]
    except KeyError:
        raise ValueError(f"no tool instructions for {call_format!r}; choose one of {sorted(_INSTRUCTIONS)}") from None
    return text.format(tools=separator.join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def with_tools_in_system_message(messages: list[dict], tools: list[dict], call_format: str) -> list[dict]:
    """`messages` (chat-template dicts) with the tools' instructions after the first system message's
    content, or in a new system message before the conversation when it has none."""
    instructions = tools_instructions(tools, call_format)
    if messages and messages[0].get("role") in ("system", "developer") and messages[0].get("content"):
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def with_calls_as_text(messages: list[dict], call_format: str) -> list[dict]:
    """`messages` with earlier assistant calls written into their content in `call_format`, and, for
    hermes, tool results as Qwen2.5's template gives them (a user turn of `<tool_response>`s), for a
    template that drops tools and so drops calls too: the model then sees what it called and got."""
    written = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            text = _calls_text([call.get("function") or {} for call in calls], call_format)
            content = message.get("content") or ""
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            message["content"] = f"{content}\n{text}" if content else text
        elif message.get("role") == "tool" and call_format == "hermes":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        written.append(message)
    return written


def _calls_text(functions: list[dict], call_format: str) -> str:
    key = "parameters" if call_format == "llama3_json" else "arguments"
    objects = [json.dumps({"name": f.get("name"), key: f.get("arguments", {})}, ensure_ascii=False) for f in functions]
    if call_format == "hermes":
        return "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in objects)
    if call_format == "llama3_json":
        return "; ".join(objects)
    return "[TOOL_CALLS][" + ", ".join(objects) + "]"
