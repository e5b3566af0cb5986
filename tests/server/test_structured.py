"""Structured outputs, tool calls and lenient bodies over HTTP, on the fake engine (exact and fast).

What reaches the engine (the Constraint of each body form), what comes back (tool calls read out
of the text, streamed and not, finish_reason and stop_reason), what is refused (400 naming the
field) and what is ignored (unknown fields, logged once per name). The grammar itself is tested
on a real model in structured/test_engine.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import tomllib
from pathlib import Path

import pytest

from orca_jax.sampling_params import SamplingParams
from orca_jax.server.app import create_app, package_version
from orca_jax.server.structured import ToolCallSettings
from orca_jax.structured import Constraint, ConstraintKind, JsonOptions
from orca_jax.structured.tool_grammar import tool_call_constraint

from tests.helpers.server import FakeEngine, asgi_client, live_server, parse_sse

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# A template in the style of those that take tools: the tools, then each turn with its calls.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</call>{% endfor %}{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def _app(engine=None, **kwargs):
    return create_app(engine or FakeEngine(), served_model_name="fake", **kwargs)


async def _constraint_of(body: dict, path: str = "/v1/chat/completions") -> Constraint | None:
    engine = FakeEngine()
    async with asgi_client(_app(engine)) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return engine.samplings[-1].structured_outputs


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     Constraint.json_schema(SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}}, Constraint.json_schema({})),
    ({"response_format": {"type": "json_object"}}, Constraint(ConstraintKind.JSON_OBJECT)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     Constraint.json_schema(SCHEMA, JsonOptions(any_whitespace=False))),
    ({"structured_outputs": {"regex": "[a-z]{3}", "choice": None}}, Constraint(ConstraintKind.REGEX, "[a-z]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint(ConstraintKind.CHOICE, ("yes", "no"))),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, Constraint(ConstraintKind.GRAMMAR, 'start: "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, Constraint(ConstraintKind.JSON_OBJECT)),
    ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
    ({"guided_regex": "\\d+"}, Constraint(ConstraintKind.REGEX, "\\d+")),
    ({"guided_choice": ["a", "b"]}, Constraint(ConstraintKind.CHOICE, ("a", "b"))),
    ({"guided_grammar": 'root ::= "x"'}, Constraint(ConstraintKind.GRAMMAR, 'root ::= "x"')),
])
@pytest.mark.anyio
async def test_every_structured_output_field_reaches_the_engine_as_its_constraint(fields, expected):
    assert await _constraint_of({**CHAT, **fields}) == expected
    assert await _constraint_of({"prompt": "x", "max_tokens": 2, **fields}, "/v1/completions") == expected


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
])
@pytest.mark.anyio
async def test_a_constraint_the_grammar_library_rejects_is_400_naming_the_field(fields, param):
    async with asgi_client(_app()) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_structured_output")


@pytest.mark.anyio
async def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog):
    engine = FakeEngine()
    body = {**CHAT, "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low",
            "functions": None, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "messages": [{"role": "user", "content": "hi", "reasoning_content": "?"}]}
    with caplog.at_level(logging.WARNING, logger="orca_jax.server.serving"):
        async with asgi_client(_app(engine)) as client:
            for _ in range(3):
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                assert parse_sse(response.text)[-1] == "[DONE]"
    warned = [re.search(r"field (\S+),", record.getMessage()).group(1) for record in caplog.records
              if "ignoring" in record.getMessage()]
    assert sorted(warned) == sorted(["'store'", "'metadata'", "'service_tier'", "'reasoning_effort'", "'functions'",
                                     "'stream_options.continuous_usage_stats'", "'messages.reasoning_content'"])


@pytest.mark.anyio
async def test_stream_options_without_stream_is_400_but_an_empty_one_is_not():
    async with asgi_client(_app()) as client:
        refused = await client.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}})
        empty = await client.post("/v1/completions", json={"prompt": "x", "stream_options": {}, "max_tokens": 1})
        null = await client.post("/v1/completions", json={"prompt": "x", "stream_options": None, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"
    assert (empty.status_code, null.status_code) == (200, 200)


@pytest.mark.anyio
async def test_stop_reason_is_the_stop_string_that_ended_the_choice():
    async with asgi_client(_app()) as client:
        stopped = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stop": ["zz", "d"]})
        length = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stop": "e",
                                                              "stream": True})
    choice = stopped.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("bc", "stop", "d")
    assert length.json()["choices"][0]["stop_reason"] is None
    events = [e for e in parse_sse(streamed.text) if e != "[DONE]"]
    assert [e["choices"][0]["stop_reason"] for e in events][-1] == "e"
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-1])


@pytest.mark.anyio
async def test_echo_puts_the_prompt_before_each_choice():
    async with asgi_client(_app()) as client:
        whole = await client.post("/v1/completions", json={"prompt": ["ab", "xy"], "max_tokens": 2, "echo": True,
                                                           "n": 2})
        ids = await client.post("/v1/completions", json={"prompt": [120, 121], "max_tokens": 1, "echo": True})
        streamed = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True,
                                                              "stream": True})
    assert [c["text"] for c in whole.json()["choices"]] == ["abcd", "abcd", "xyza", "xyza"]
    assert whole.json()["usage"]["completion_tokens"] == 8  # the echo is no completion
    assert ids.json()["choices"][0]["text"] == "xyz"  # token ids echo as their text
    events = [e for e in parse_sse(streamed.text) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == "abcd" and events[0]["choices"][0]["text"] == "abc"


# ---- tools ---------------------------------------------------------------------------------------

def _tools_app(reply: str = HERMES_REPLY, **settings):
    engine = FakeEngine(reply=reply, max_model_len=1024, num_pages=1024)
    app = _app(engine, chat_template=TOOLS_TEMPLATE,
               tool_calls=ToolCallSettings(**({"parser": "hermes", "enable_auto_tool_choice": True} | settings)))
    return engine, app


def _reassemble(events: list) -> tuple[str | None, list[dict], str]:
    """(content, calls, finish_reason) of a streamed choice, put together as a client does."""
    content, calls, finish = "", {}, None
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        content += choice["delta"].get("content") or ""
        for piece in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.get("id") or call["id"]
            call["name"] = piece["function"].get("name") or call["name"]
            call["arguments"] += piece["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.anyio
async def test_auto_tool_calls_are_parsed_streamed_or_not_and_the_tools_are_in_the_prompt():
    engine, app = _tools_app()
    body = {"messages": [{"role": "user", "content": "Weather in Paris, and 1 + 2?"}], "tools": [WEATHER, ADD],
            "max_tokens": 200}
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = parse_sse((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    prompt = bytes(engine.prompts[0]).decode()
    assert prompt.startswith("<tools>" + json.dumps(WEATHER, ensure_ascii=False) + json.dumps(ADD) + "</tools>\n")
    assert engine.samplings[0].structured_outputs is None  # auto: the model decides
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])
    content, streamed_calls, finish = _reassemble(streamed)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls


@pytest.mark.anyio
async def test_auto_without_calls_is_plain_content_and_auto_needs_the_flag():
    _, app = _tools_app(reply="Just text.")
    _, app_without = _tools_app(parser=None, enable_auto_tool_choice=False)
    body = {**CHAT, "tools": [WEATHER], "max_tokens": 40}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
    async with asgi_client(app_without) as client:
        refused = await client.post("/v1/chat/completions", json=body)
        none = await client.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert plain["message"] == {"role": "assistant", "content": "Just text."} and plain["finish_reason"] == "stop"
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "auto_tool_choice_disabled"
    assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]


@pytest.mark.parametrize("parser", [None, "hermes", "llama3_json"])
@pytest.mark.anyio
async def test_required_and_named_tool_choices_send_the_grammar_of_the_parsers_format(parser):
    reply = '{"name": "add", "parameters": {"a": 1, "b": 2}}' if parser == "llama3_json" else \
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    engine, app = _tools_app(reply=reply, parser=parser, enable_auto_tool_choice=False)
    named = {"type": "function", "function": {"name": "add"}}
    body = {**CHAT, "tools": [WEATHER, ADD], "max_tokens": 100}
    async with asgi_client(app) as client:
        required = (await client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})).json()
        forced = (await client.post("/v1/chat/completions", json={**body, "tool_choice": named,
                                                                  "parallel_tool_calls": False})).json()
    call_format = parser or "hermes"
    assert engine.samplings[0].structured_outputs == tool_call_constraint([WEATHER, ADD], "required", call_format)
    assert engine.samplings[1].structured_outputs == tool_call_constraint([WEATHER, ADD], named, call_format)
    for response, finish in ((required, "tool_calls"), (forced, "stop")):  # vLLM's finish reasons
        choice = response["choices"][0]
        assert choice["finish_reason"] == finish and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("add", {"a": 1, "b": 2})


@pytest.mark.anyio
async def test_tool_turns_and_earlier_calls_render_back_into_the_prompt():
    engine, app = _tools_app(reply="It is sunny.")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER],
                                                                    "max_tokens": 20})
    assert response.json()["choices"][0]["message"]["content"] == "It is sunny."
    prompt = bytes(engine.prompts[0]).decode()
    # (trim_blocks, as transformers renders, takes the newline after each block tag)
    assert prompt.endswith('<|user|>Weather?<|assistant|><call id=call_1>get_weather {"city": "Paris"}</call>'
                           "<|tool|>sunny[answers call_1]<|assistant|>")


# ---- /tokenize, /detokenize, /version, /ping -----------------------------------------------------

@pytest.mark.anyio
async def test_tokenize_and_detokenize_prompt_and_chat_forms():
    engine = FakeEngine()
    async with asgi_client(_app(engine, api_key="k")) as client:
        headers = {"Authorization": "Bearer k"}
        prompt = (await client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True},
                                    headers=headers)).json()
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                                  headers=headers)).json()
        back = (await client.post("/detokenize", json={"tokens": prompt["tokens"]}, headers=headers)).json()
        bad = await client.post("/detokenize", json={"tokens": [1, 999]}, headers=headers)
        no_key = await client.post("/tokenize", json={"prompt": "x"})
        version = (await client.get("/version")).json()
        ping = await client.get("/ping")
    assert prompt == {"count": 3, "max_model_len": 128, "tokens": [104, 195, 169], "token_strs": ["h", "Ã", "©"]}
    assert chat["tokens"] == engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert chat["count"] == len(chat["tokens"]) and chat["token_strs"] is None
    assert back == {"prompt": "hé"}
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "token_id_out_of_range"
    assert no_key.status_code == 401  # like /v1, behind the key
    assert version["version"] == package_version()  # installed: the distribution's
    assert ping.status_code == 200 and ping.json() == {"status": "ok"}


@pytest.mark.anyio
async def test_version_of_a_checkout_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    async with asgi_client(_app()) as client:
        response = await client.get("/version")
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert response.status_code == 200 and response.json() == {"version": project["version"]}


# ---- through the official openai client ------------------------------------------------------------

def test_openai_client_parse_and_streamed_tool_calls():
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    engine = FakeEngine(reply='{"name": "Ada", "age": 36}', max_model_len=1024, num_pages=1024)
    _, tool_app = _tools_app()
    with live_server(_app(engine)) as server, live_server(tool_app) as tool_server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.parse(model="fake", messages=[{"role": "user", "content": "Ada?"}],
                                                   response_format=Person, max_tokens=50)
        tools_client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
        with tools_client.chat.completions.stream(model="fake", messages=[{"role": "user", "content": "?"}],
                                                  tools=[WEATHER, ADD], max_tokens=300) as stream:
            final = stream.get_final_completion()
    assert completion.choices[0].message.parsed == Person(name="Ada", age=36)
    constraint = engine.samplings[0].structured_outputs
    assert constraint.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(constraint.spec)["required"] == ["name", "age"]  # the client's strict schema
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me look."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


# ---- vLLM's sampling fields ------------------------------------------------------------------------

@pytest.mark.anyio
async def test_every_vllm_sampling_field_reaches_sampling_params():
    engine = FakeEngine()
    fields = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2, "min_p": 0.1,
              "min_tokens": 2, "logit_bias": {"97": 3.5, "98": -100}, "bad_words": ["xyz"],
              "allowed_token_ids": [97, 98, 99], "skip_special_tokens": False, "spaces_between_special_tokens": False,
              "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True, "top_k": -1,
              "top_p": 0.9, "temperature": 0.7, "seed": 11, "stop": ["q"]}
    async with asgi_client(_app(engine)) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, **fields})
        top = await client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 21})
    assert response.status_code == 200, response.text
    sampling = engine.samplings[-1]
    assert sampling == SamplingParams(
        max_tokens=5, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.1, min_tokens=2,
        logit_bias={97: 3.5, 98: -100.0}, bad_words=("xyz",), allowed_token_ids=(97, 98, 99),
        skip_special_tokens=False, spaces_between_special_tokens=False, stop_token_ids=(5,),
        include_stop_str_in_output=True, ignore_eos=True, top_k=0, top_p=0.9, temperature=0.7, seed=11, stop=("q",))
    assert top.status_code == 400 and top.json()["error"]["param"] == "top_logprobs"  # past --max-logprobs (20)


@pytest.mark.anyio
@pytest.mark.parametrize("parser, keeps", [("hermes", False), ("llama3_json", True), ("mistral", True)])
async def test_tool_parsers_that_read_special_tokens_get_them_in_the_text(parser, keeps):
    engine, app = _tools_app(reply="plain", parser=parser)
    async with asgi_client(app) as client:
        await client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
        await client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert [s.skip_special_tokens for s in engine.samplings] == [not keeps, True]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.anyio
async def test_a_constrained_output_cut_by_max_tokens_is_logged_with_what_to_do(caplog, stream):
    """finish_reason "length" stays the answer's only sign (OpenAI's; the openai client's .parse() raises on
    it); the server's log says which field's output was cut and how to avoid it. A free output is not logged."""
    async with asgi_client(_app(FakeEngine(reply='{"name": "Ada", "age": 36}'))) as client:
        with caplog.at_level(logging.WARNING, logger="orca_jax.server.serving"):
            cut = await client.post("/v1/chat/completions", json={
                **CHAT, "response_format": {"type": "json_object"}, "max_tokens": 5, "stream": stream})
            free = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "stream": stream})
    assert cut.status_code == free.status_code == 200
    assert '"finish_reason":"length"' in cut.text.replace(" ", "")
    (line,) = [r.getMessage() for r in caplog.records if "max_tokens=5 cut" in r.getMessage()]
    assert "cut 1 of 1 choices short of the output response_format asks for" in line and "maxLength" in line
