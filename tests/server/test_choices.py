"""Several choices per response (n > 1, lists of prompts) over the fake engine, and chat defaults."""

import json

import pytest

from orca_jax.server.app import create_app
from orca_jax.server.async_engine import AsyncEngine
from orca_jax.server.choices import derive_seed
from orca_jax.server.serving import DEFAULT_MAX_TOKENS
from orca_jax.serve import build_parser, engine_config_from_args

from tests.helpers.server import FakeEngine, asgi_client, expected_text, parse_sse, wait_until

pytestmark = pytest.mark.anyio


def test_derived_seeds_keep_the_first_and_differ_after():
    assert derive_seed(None, 3) is None and derive_seed(7, 0) == 7
    seeds = [derive_seed(7, number) for number in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**32 for s in seeds)
    assert derive_seed(7, 1) != derive_seed(8, 0)  # not seed + number


async def test_n_choices_are_separate_requests_with_derived_seeds():
    engine = FakeEngine()
    async with asgi_client(create_app(engine)) as client:
        body = (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "n": 3,
                                                           "seed": 7, "logprobs": 1})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == expected_text("hello", 4) for c in body["choices"])
    assert all(c["logprobs"]["text_offset"] == [0, 1, 2, 3] for c in body["choices"])  # per choice
    assert [s.seed for s in engine.samplings] == [7, derive_seed(7, 1), derive_seed(7, 2)]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


async def test_a_list_of_prompts_gets_n_choices_each_in_order():
    engine = FakeEngine()
    async with asgi_client(create_app(engine)) as client:
        texts = (await client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "max_tokens": 3,
                                                            "n": 2})).json()
        ids = (await client.post("/v1/completions", json={"prompt": [list(b"ab"), list(b"q")],
                                                          "max_tokens": 2})).json()
    # OpenAI's order: choice prompt_index * n + number.
    assert [c["text"] for c in texts["choices"]] == ["cde", "cde", "abc", "abc"]
    assert [c["index"] for c in texts["choices"]] == [0, 1, 2, 3]
    assert texts["usage"]["prompt_tokens"] == 2 + 3  # each prompt once, however many choices
    assert texts["usage"]["completion_tokens"] == 4 * 3
    assert [c["text"] for c in ids["choices"]] == ["cd", "rs"]


async def test_streamed_choices_carry_their_index():
    async with asgi_client(create_app(FakeEngine())) as client:
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}})
        completion = await client.post("/v1/completions", json={
            "prompt": ["ab", "xyz"], "max_tokens": 3, "stream": True})
    events = parse_sse(chat.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert len("".join(c["delta"].get("content", "") for c in mine)) == 3
        assert [c["finish_reason"] for c in mine][-1] == "length"
    events = parse_sse(completion.text)
    by_index = {0: "", 1: ""}
    for chunk in events[:-1]:
        by_index[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert by_index == {0: "cde", 1: "abc"}


async def test_too_many_choices_and_best_of_are_400():
    engine = FakeEngine()
    app = create_app(AsyncEngine(engine, max_in_flight=4))
    async with asgi_client(app) as client:
        too_many = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        best_of = await client.post("/v1/completions", json={"prompt": "a", "n": 2, "best_of": 4})
        same = await client.post("/v1/completions", json={"prompt": "a", "n": 2, "best_of": 2, "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert best_of.status_code == 400 and "best_of" in best_of.json()["error"]["message"]
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
    assert engine.prompts == [[ord("a")]] * 2


async def test_stop_strings_past_the_limits_are_400_before_anything_is_queued():
    engine = FakeEngine()
    limits = engine.config.sampling
    async with asgi_client(create_app(engine)) as client:
        many = await client.post("/v1/completions", json={
            "prompt": "a", "n": 4, "stop": [f"s{i}" for i in range(limits.max_stop_strings + 1)]})
        long = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "stop": ["x" * limits.max_stop_chars, "y"]})
        at_limits = await client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 1, "stop": ["x" * (limits.max_stop_chars - limits.max_stop_strings + 1)]
            + ["y"] * (limits.max_stop_strings - 1)})
    for response in (many, long):
        error = response.json()["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == ("stop", "too_many_stop_strings")
    assert "--max-stop-strings" in many.json()["error"]["message"]
    assert "--max-stop-chars" in long.json()["error"]["message"]
    assert at_limits.status_code == 200, at_limits.text
    assert engine.prompts == [[ord("a")]]


def test_the_stop_string_flags_set_the_engines_limits():
    args = build_parser().parse_args(["--max-stop-strings", "3", "--max-stop-chars", "30"])
    limits = engine_config_from_args(args).sampling
    assert (limits.max_stop_strings, limits.max_stop_chars) == (3, 30)


async def test_a_refused_choice_takes_its_siblings_with_it():
    # 100 tokens at 50 ms a step: the accepted choices cannot finish on their own inside wait_until's 5 s.
    engine = FakeEngine(max_num_seqs=1, max_waiting=2, step_seconds=0.05)
    async with asgi_client(create_app(AsyncEngine(engine, max_in_flight=100))) as client:
        response = await client.post("/v1/completions", json={"prompt": "a", "n": 5, "max_tokens": 100})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        # The aborts travel to the engine thread as commands, so they land just after the reply.
        await wait_until(lambda: not engine.has_unfinished())
        assert engine.aborted  # the accepted ones were aborted, not left running
        assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200


async def test_chat_without_max_tokens_gets_the_default_cap():
    engine = FakeEngine(max_model_len=4096, num_pages=2048)
    async with asgi_client(create_app(engine)) as client:
        capped = (await client.post("/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "x"}]})).json()
    async with asgi_client(create_app(FakeEngine(max_model_len=300), default_max_tokens=None)) as client:
        whole = (await client.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "x"}]})).json()
    assert capped["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS == 256
    assert engine.samplings[0].max_tokens == 256
    assert whole["usage"]["total_tokens"] == 300  # None: the rest of the context, as before


async def test_completions_keep_openais_default_of_16():
    async with asgi_client(create_app(FakeEngine())) as client:
        body = (await client.post("/v1/completions", json={"prompt": "a"})).json()
    assert body["usage"]["completion_tokens"] == 16


async def test_openai_message_fields_echoed_back_are_accepted():
    reply = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None,
             "function_call": None, "audio": None, "annotations": []}
    async with asgi_client(create_app(FakeEngine())) as client:
        response = await client.post("/v1/chat/completions", content=json.dumps({
            "messages": [{"role": "user", "content": "x"}, reply, {"role": "user", "content": "y"}],
            "max_tokens": 1, "response_format": {"type": "text"}, "tool_choice": "none", "top_k": 5,
            "ignore_eos": True, "priority": 3, "deadline": 10.0}),
            headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
