"""Which chat templates drop tools (SmolLM2's), which format a template writes calls in, and the
instructions that put tools into a system message for those that drop them."""

from __future__ import annotations

import json

import pytest

from orca_jax.chat_template import renders_tools
from orca_jax.structured.tool_parsers import get_tool_parser
from orca_jax.structured.tool_prompt import (tool_call_format_of, tools_instructions, with_calls_as_text,
                                             with_tools_in_system_message)
from orca_jax.tokenizer import ByteTokenizer
from tests.helpers.structured import smollm2_tokenizer

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
# Qwen2.5's way with tools, cut down: the signatures in the system turn, calls as <tool_call>.
QWEN_LIKE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
             "\nreturn <tool_call></tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}"
             "\n{{ m.content }}<|im_end|>\n{% endfor %}")


def test_smollm2_and_the_byte_template_drop_tools_and_tool_templates_do_not():
    assert not renders_tools(smollm2_tokenizer().chat_template)
    assert not renders_tools(ByteTokenizer().chat_template)
    assert renders_tools(QWEN_LIKE)
    # Tools changing the prompt without naming them do not count as shown.
    assert not renders_tools("{% if tools %}You have tools.{% endif %}{{ messages[0].content }}")
    # A template that fails on the probe is left alone.
    assert renders_tools("{{ raise_exception('no') }}")


@pytest.mark.parametrize("template, expected", [
    (QWEN_LIKE, "hermes"), ("{{ '<|python_tag|>' }}", "llama3_json"), ("[TOOL_CALLS]", "mistral"),
    ("{{ messages }}", "hermes"), (None, "hermes")])
def test_the_call_format_is_read_from_the_template(template, expected):
    assert tool_call_format_of(template) == expected


@pytest.mark.parametrize("call_format", ["hermes", "llama3_json", "mistral"])
def test_the_instructions_show_each_tool_and_a_call_the_parser_reads(call_format):
    text = tools_instructions([ADD, ADD], call_format)
    assert text.count(json.dumps(ADD)) == 2
    example = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
               "llama3_json": '{"name": "add", "parameters": {"a": 1}}',
               "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'}[call_format]
    _, (call,) = get_tool_parser(call_format).parse(example)
    assert call.name == "add"
    with pytest.raises(ValueError, match="no tool instructions"):
        tools_instructions([ADD], "pythonic")


def test_the_instructions_join_a_system_message_or_come_first():
    user = {"role": "user", "content": "1 + 2?"}
    added = with_tools_in_system_message([user], [ADD], "hermes")
    assert added == [{"role": "system", "content": tools_instructions([ADD], "hermes")}, user]
    system = {"role": "system", "content": "Be brief."}
    joined = with_tools_in_system_message([system, user], [ADD], "hermes")
    assert joined == [{"role": "system", "content": "Be brief.\n\n" + tools_instructions([ADD], "hermes")}, user]
    assert system == {"role": "system", "content": "Be brief."}  # not changed in place


def test_earlier_calls_and_results_are_written_in_the_format_the_parser_reads():
    messages = [{"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    user, assistant, tool = with_calls_as_text(messages, "hermes")
    assert user == messages[0] and assistant == {"role": "assistant", "content": (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')}
    assert tool == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    for call_format in ("hermes", "llama3_json", "mistral"):
        assistant = with_calls_as_text(messages, call_format)[1]
        _, (call,) = get_tool_parser(call_format).parse(assistant["content"])
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert with_calls_as_text(messages, "llama3_json")[2] == messages[2]  # tool turns kept outside hermes
