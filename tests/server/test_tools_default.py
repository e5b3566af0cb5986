"""Tools out of the box, on the fake engine: a server started with no tool flags answers tools
without tool_choice ("auto"), shows the tools to a model whose template drops them (a system message
in the parser's format), picks the parser from the template, streams a call's arguments as they
come and reports a call cut by max_tokens as a call with finish_reason "length"."""

from __future__ import annotations

import json
import logging

import pytest

from orca_jax.server.app import create_app
from orca_jax.structured.tool_grammar import tool_call_constraint
from orca_jax.structured.tool_prompt import tools_instructions

from tests.helpers.server import FakeEngine, asgi_client, parse_sse

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
ARGUMENTS = '{"city": "Paris", "days": 3}'
REPLY = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _app(reply: str = REPLY, **kwargs):
    engine = FakeEngine(reply=reply, max_model_len=2048, num_pages=1024)
    return engine, create_app(engine, served_model_name="fake", **kwargs)


def _prompt(engine, index: int = -1) -> str:
    return bytes(engine.prompts[index]).decode()


def _stream_pieces(events: list) -> tuple[list[dict], str | None]:
    """Every delta.tool_calls piece of a streamed choice, in order, and its finish_reason."""
    pieces, finish = [], None
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        pieces += choice["delta"].get("tool_calls") or []
        finish = choice["finish_reason"] or finish
    return pieces, finish


async def test_tools_without_tool_choice_are_auto_and_shown_in_a_system_message():
    engine, app = _app()  # no tool settings: serve's defaults; the byte tokenizer's template drops tools
    async with asgi_client(app) as client:
        auto = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
        none = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": "none", "max_tokens": 5})
    assert auto.status_code == 200, auto.text
    choice = auto.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    assert engine.samplings[0].structured_outputs is None  # auto: the model decides
    # The byte template writes `<|role|>\ncontent\n`: the instructions are a system turn before the user's.
    assert _prompt(engine, 0).startswith(f"<|system|>\n{tools_instructions([WEATHER], 'hermes')}\n<|user|>\n")
    assert json.dumps(WEATHER) in _prompt(engine, 0) and "<tool_call>" in _prompt(engine, 0)
    # tool_choice "none": the model may not call, so the tools are not shown
    assert none.status_code == 200 and _prompt(engine) == "<|user|>\nWeather in Paris?\n<|assistant|>\n"
    assert "tool_calls" not in none.json()["choices"][0]["message"]


async def test_the_tools_go_after_a_system_message_and_are_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="orca_jax.server.serving"):
        engine, app = _app()
        async with asgi_client(app) as client:
            for _ in range(2):
                response = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": "Be brief."}, *ASK], "tools": [WEATHER],
                    "tool_choice": "required"})
                assert response.status_code == 200, response.text
    assert _prompt(engine).startswith(f"<|system|>\nBe brief.\n\n{tools_instructions([WEATHER], 'hermes')}\n<|user|>")
    notes = [r for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(notes) == 1 and "hermes" in notes[0].getMessage()


async def test_a_template_that_renders_tools_gets_them_and_names_the_parser():
    # A Llama 3.1-style template: it writes the tools itself and its calls after <|python_tag|>.
    template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                "{{ m.content }}\n{% endfor %}{# calls start with <|python_tag|> #}assistant:")
    reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    engine, app = _app(reply=reply, chat_template=template)
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                                    "tool_choice": "required"})
    assert response.status_code == 200, response.text
    assert _prompt(engine) == f"TOOLS {json.dumps([WEATHER])}\nuser: Weather in Paris?\nassistant:"
    assert engine.samplings[0].structured_outputs == tool_call_constraint([WEATHER], "required", "llama3_json")
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_streamed_arguments_come_in_many_chunks_and_add_up_to_the_call():
    _, app = _app()
    async with asgi_client(app) as client:
        events = parse_sse((await client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "stream": True})).text)
    pieces, finish = _stream_pieces(events)
    assert finish == "tool_calls"
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    with_arguments = [p for p in pieces if p["function"].get("arguments")]
    assert len(with_arguments) > 10  # one per generated character here, not one at the end
    assert all(p["index"] == 0 and p.get("id") is None for p in pieces[1:])
    assert "".join(p["function"].get("arguments") or "" for p in pieces) == ARGUMENTS


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_by_max_tokens_is_a_call_with_finish_reason_length(stream):
    _, app = _app()
    cut = REPLY.index('"days"')  # inside the arguments
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": cut, "stream": stream})
    if stream:
        pieces, finish = _stream_pieces(parse_sse(response.text))
        name, arguments = pieces[0]["function"]["name"], "".join(p["function"].get("arguments") or "" for p in pieces)
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in parse_sse(response.text)
                          if e != "[DONE]" and e["choices"])
    else:
        choice = response.json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        name, arguments, finish = call["function"]["name"], call["function"]["arguments"], choice["finish_reason"]
        content = choice["message"]["content"] or ""
    assert finish == "length" and content == ""  # no markup in the content
    assert name == "get_weather" and arguments == '{"city": "Paris", '  # the arguments written so far


@pytest.mark.parametrize("stream", [False, True])
async def test_required_cut_inside_the_next_calls_opener_sends_no_markup_as_content(stream):
    """tool_choice "required" with max_tokens cutting the second call's `<tool_call>` at each character:
    the first call comes back, finish_reason "length", and no piece of the opener in the content."""
    reply = REPLY + "\n" + REPLY
    second = len(REPLY) + 1
    for cut in range(second, second + len("<tool_call>")):
        _, app = _app(reply)
        async with asgi_client(app) as client:
            response = await client.post("/v1/chat/completions", json={
                "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": cut, "stream": stream})
        if stream:
            events = [e for e in parse_sse(response.text) if e != "[DONE]" and e["choices"]]
            pieces, finish = _stream_pieces(events)
            calls = [p for p in pieces if p.get("id")]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        else:
            choice = response.json()["choices"][0]
            calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
            content = choice["message"]["content"] or ""
        assert finish == "length" and content == "", (cut, content)
        assert [call["function"]["name"] for call in calls] == ["get_weather"], cut


def test_serve_flags_default_to_auto_with_the_templates_parser():
    from orca_jax.server.cli_args import parse_args, tool_call_settings_from_args
    from orca_jax.server.structured import ToolCallSettings

    assert tool_call_settings_from_args(parse_args([])) == ToolCallSettings(parser=None, enable_auto_tool_choice=True)
    assert tool_call_settings_from_args(parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])) \
        == ToolCallSettings(parser="mistral", enable_auto_tool_choice=True)  # vLLM's flags still work
    assert not tool_call_settings_from_args(parse_args(["--no-enable-auto-tool-choice"])).enable_auto_tool_choice
    assert ToolCallSettings().for_template("{{ '<|python_tag|>' }}").parser == "llama3_json"
    assert ToolCallSettings(parser="hermes").for_template("[TOOL_CALLS]").parser == "hermes"  # a given parser wins


def test_langchain_bind_tools_invoke_without_tool_choice_reads_the_models_call():
    """LangChain's exchange (tools, no tool_choice) on a server with no tool flags: a model that
    writes a hermes call gets it back as tool_calls (SmolLM2 itself: tests/server/test_tools_smollm2.py)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from tests.helpers.server import live_server

    _, app = _app()
    with live_server(app) as server:
        model = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="fake",
                                            max_tokens=200, max_retries=0)
        message = model.bind_tools([WEATHER]).invoke("Weather in Paris?")
        streamed = None
        for chunk in model.bind_tools([WEATHER]).stream("Weather in Paris?"):
            streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]


async def test_a_template_that_drops_tools_sees_earlier_calls_and_results_as_text():
    engine, app = _app(reply="It is sunny.")
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert _prompt(engine).endswith(
        '<|user|>\nWeather in Paris?\n<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<|user|>\n<tool_response>\nsunny\n</tool_response>\n<|assistant|>\n')
