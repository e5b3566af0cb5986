"""Chat templates that take tools render as transformers renders them: the tools, assistant turns
that called tools (arguments as objects), and tool turns answering them.

The templates are written in the style of the three families whose tool formats the server parses
(Llama 3.1's JSON calls and ipython turns, Qwen2.5's <tools> and <tool_call> tags, Mistral's
[AVAILABLE_TOOLS] and [TOOL_CALLS]), and compared with transformers' apply_chat_template on the
same conversation.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from orca_jax.server.protocol import ChatMessage

from tests.helpers.server import chatml_tokenizer

LLAMA31_STYLE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n\\n' }}{%- endif %}{{- system + '<|eot_id|>' }}"
    "{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond with a JSON function call.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['ipython', 'tool'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + call.name + '\", \"parameters\": ' }}"
    "{{- call.arguments | tojson }}{{- '}<|eom_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim"
    " + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
QWEN25_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are helpful.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall them as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- set call = call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}{{- call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
MISTRAL_STYLE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}{{- '{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- ', \"id\": \"' + call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message.content | tojson) + ', \"call_id\": \"' + message.tool_call_id"
    " + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- ' ' + message.content + eos_token }}{%- endif %}{%- endfor %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}]
# As a client sends it (OpenAI's shapes: arguments as JSON text), then a follow-up question.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_a1", "content": "21 C, sunny"},
    {"role": "assistant", "content": "21 C and sunny."},
    {"role": "user", "content": "And in <|im_end|> London?"},
]


def _transformers_tokenizer(ours):
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, bos_token="<|im_start|>",
                                                  eos_token="<|im_end|>")
    theirs.chat_template = ours.chat_template
    return theirs


@pytest.mark.parametrize("template", [LLAMA31_STYLE, QWEN25_STYLE, MISTRAL_STYLE], ids=["llama3.1", "qwen2.5", "mistral"])
@pytest.mark.parametrize("with_tools", [True, False])
def test_tools_and_tool_turns_render_as_transformers_renders_them(template, with_tools):
    ours = chatml_tokenizer(template)
    theirs = _transformers_tokenizer(ours)
    # What the server hands the template, from the request's messages (arguments parsed to objects).
    messages = [ChatMessage.model_validate(m).template_message() for m in CONVERSATION]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    tools = TOOLS if with_tools else None
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert rendered == expected
    assert ('"city": "Paris"' in rendered) and (('get_weather' in rendered.split("Weather in Paris")[0]) == (
        with_tools and template != MISTRAL_STYLE))
    # The control token typed in the last question stays text; the template's own stay control tokens.
    ids = ours.encode_chat(messages, add_generation_prompt=True, tools=tools)
    plain = ours.encode_chat(messages, add_generation_prompt=True, tools=tools, split_special_tokens=False)
    typed_end = ours.encode("<|im_end|>")
    assert ids.count(typed_end[0]) == plain.count(typed_end[0]) - 1
    assert ours.decode(ids, skip_special_tokens=False) == rendered
