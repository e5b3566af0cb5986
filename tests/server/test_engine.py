"""The server over the real engine (tiny-llama: random weights, byte tokenizer; SmolLM2 when slow).

One engine serves the whole module (loading and compiling dominate on CPU). The buckets are kept
to a minimum: a token budget equal to the batch size means T is always 8, so only S varies.
"""

import asyncio
import functools
import random
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from orca_jax.config import SchedulingPolicy
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.app import create_app
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.engines import tiny_engine
from tests.helpers.fuzz import any_request, check_answer, driven, post_json
from tests.helpers.server import live_server, parse_sse

MAX_BATCH = 8
PROMPTS = ["Once upon a time", "The quick brown fox", "ORCA schedules at iteration level"]


# The served engine's settings (tiny_engine's arguments): every program compiled before serving.
SERVED = dict(page_size=16, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_BATCH, precompile=True,
              scheduler_options=dict(max_waiting=512, policy=SchedulingPolicy.PRIORITY))


def _run_directly(engine: Engine, prompt, sampling: SamplingParams):
    """The engine's own answer, no server involved (must not run while an app drives the engine)."""
    request_id = engine.add_request(prompt, sampling)
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError("engine drained without finishing the request")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(**SERVED)


@pytest.fixture(params=["thread", "process"])
def mode(request) -> str:
    """Where the served engine runs: on a thread of this process, or as an engine core in a child."""
    return request.param


def _served(engine: Engine, mode: str):
    """What an app drives: the module's engine, or in process mode an engine core built alike (same
    config and seed, so the same weights and answers) in a spawned process; each app gets its own."""
    return engine if mode == "thread" else ProcessEngine(functools.partial(tiny_engine, **SERVED))


def _messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt}]


def test_openai_client_gets_what_the_engine_computes(engine, mode):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected_completion = [_run_directly(engine, p, greedy) for p in PROMPTS]
    chat_prompts = [engine.tokenizer.apply_chat_template(_messages(p), add_generation_prompt=True)
                    for p in PROMPTS]
    expected_chat = [_run_directly(engine, p, greedy) for p in chat_prompts]

    with live_server(create_app(_served(engine, mode), served_model_name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for prompt, expected in zip(PROMPTS, expected_completion):
            got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == expected.text
            assert got.choices[0].finish_reason == expected.finish_reason
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
                expected.num_prompt_tokens, len(expected.output_token_ids))
            streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
            assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == expected.finish_reason
            assert streamed[-1].usage.completion_tokens == len(expected.output_token_ids)

        for prompt, expected in zip(PROMPTS, expected_chat):
            got = client.chat.completions.create(model="tiny", messages=_messages(prompt), max_tokens=12,
                                                 temperature=0, logprobs=True)
            assert got.choices[0].message.content == expected.text
            assert got.usage.prompt_tokens == expected.num_prompt_tokens
            assert got.usage.completion_tokens == len(got.choices[0].logprobs.content)
            streamed = list(client.chat.completions.create(model="tiny", messages=_messages(prompt),
                                                           max_tokens=12, temperature=0, stream=True))
            assert streamed[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text
            assert streamed[-1].choices[0].finish_reason == expected.finish_reason


def test_seeded_sampling_is_reproducible_over_http(engine, mode):
    with live_server(create_app(_served(engine, mode))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        texts = [client.completions.create(model="tiny-llama", prompt="seeded", max_tokens=8, temperature=1.0,
                                           top_p=0.9, extra_body={"top_k": 50}, seed=1234).choices[0].text
                 for _ in range(2)]
    assert texts[0] == texts[1]


def test_openai_client_gets_n_distinct_seeded_choices_streamed_and_not(engine, mode):
    with live_server(create_app(_served(engine, mode))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model="tiny-llama", messages=_messages("Tell me a story"), max_tokens=8,
                      temperature=1.0, seed=1234, n=3)
        full = client.chat.completions.create(**kwargs)
        streamed = list(client.chat.completions.create(**kwargs, stream=True,
                                                       stream_options={"include_usage": True}))
        single = client.chat.completions.create(**{**kwargs, "n": 1})
    texts = [choice.message.content for choice in full.choices]
    assert [choice.index for choice in full.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # distinct derived seeds
    assert texts[0] == single.choices[0].message.content  # the first choice keeps the request's seed
    by_index = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index == texts  # same seeds, same choices
    assert streamed[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once


def test_the_start_up_log_and_metrics_agree_on_the_kv_pool(engine):
    from orca_jax.serve import startup_report

    usable = engine.runner.num_pages - 1  # page 0 is the scratch page
    assert f"KV pool: {usable} pages x 16 tokens" in startup_report(engine)[-1]
    app = create_app(engine, served_model_name="m")
    with driven(app) as call:
        text = call("GET", "/metrics").text
    assert f'orca_jax:kv_cache_total_pages{{model_name="m"}} {float(usable)}' in text


def test_length_limits_come_from_the_engine(engine, mode):
    with live_server(create_app(_served(engine, mode))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="tiny-llama", prompt="x" * (engine.max_model_len + 1))
        assert raised.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-llama", prompt="x" * 10, max_tokens=engine.max_model_len)


def test_many_concurrent_streams_with_random_disconnects(engine, mode):
    """200+ streams at once; about a third hang up early. Everyone else gets every token, the KV
    pool drains to empty, and /health stays 200 throughout."""
    num_requests, max_tokens = 220, 8
    rng = random.Random(0)
    hang_up_after = {i: rng.randint(0, 3) for i in rng.sample(range(num_requests), num_requests // 3)}

    async def scenario(url: str, app) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            health_codes: list[int] = []
            done = asyncio.Event()

            async def watch_health():
                while not done.is_set():
                    health_codes.append((await client.get("/health")).status_code)
                    await asyncio.sleep(0.2)

            async def one(i: int):
                body = {"prompt": f"request {i}: " + "x" * rng.randint(0, 20), "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}, "priority": i % 3}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    events = []
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                            if i in hang_up_after and len(events) > hang_up_after[i]:
                                return None  # leaving the block closes the connection
                return parse_sse("\n\n".join(events) + "\n\n")

            watcher = asyncio.create_task(watch_health())
            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(num_requests))), 120)
            stats = app.state.async_engine
            deadline = time.monotonic() + 10
            while (stats.latest_stats.kv_pages_used or stats.latest_stats.kv_pages_reserved
                   or stats.latest_stats.num_running
                   or stats.latest_stats.num_waiting or stats.num_in_flight):
                assert time.monotonic() < deadline, stats.latest_stats
                await asyncio.sleep(0.05)
            health_codes.append((await client.get("/health")).status_code)
            done.set()
            await watcher
        completed = [r for r in results if r is not None]
        assert len(completed) >= num_requests - len(hang_up_after)
        for events in completed:
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == max_tokens
            assert [c["choices"][0]["finish_reason"] for c in events[:-2]][-1] == "length"
        assert set(health_codes) == {200}

    app = create_app(_served(engine, mode))
    with live_server(app) as server:
        asyncio.run(scenario(server.url, app))
    # In process mode the scenario read the core's own counts: every page freed there.
    stats = engine.stats()
    assert stats.kv_pages_used == stats.kv_pages_reserved == 0 and not engine.has_unfinished()


def test_fuzzed_requests_never_5xx_on_the_real_engine(engine, mode):
    """The fake cannot show what the real engine refuses or trips over (seeds, top_k, logprobs)."""
    app = create_app(_served(engine, mode), served_model_name="fake", max_body_bytes=8192)
    async_engine = app.state.async_engine
    with driven(app) as call:
        @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(any_request())
        def check(path_and_body):
            check_answer(post_json(call, path_and_body))

        check()
        assert call("GET", "/health").status_code == 200
        # A request refused or abandoned after it reached the engine is aborted on the engine
        # thread's next step: on a busy machine that may come after the last response.
        deadline = time.monotonic() + 10
        while (async_engine.latest_stats.num_running or async_engine.latest_stats.num_waiting
               or async_engine.latest_stats.kv_pages_used or engine.has_unfinished()):
            assert time.monotonic() < deadline, "requests left in the engine"
            call("GET", "/health")  # lets the loop run
            time.sleep(0.05)
    assert not engine.has_unfinished() and engine.stats().kv_pages_used == 0


@pytest.mark.slow
def test_smollm2_chat_over_http_matches_the_engine():
    engine = tiny_engine("smollm2-135m", num_pages=64, **SERVED)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = _run_directly(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    with live_server(create_app(engine, served_model_name="smollm2")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        streamed = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                                       temperature=0, stream=True))
    assert got.choices[0].message.content == expected.text
    assert "Paris" in expected.text
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text


def test_nothing_compiles_after_the_server_reports_ready():
    """The serving path of `python -m orca_jax.serve`: an engine built without compiling, an
    AsyncEngine that compiles every program before /health says ok; then prompts of every length the
    budget allows, sampled and greedy, with logprobs, streamed and not, compile nothing more."""
    from orca_jax.server.async_engine import AsyncEngine

    engine = tiny_engine(page_size=16, num_pages=64, max_num_seqs=4, max_num_batched_tokens=24,
                         scheduler_options=dict(max_waiting=64))
    assert engine.runner.compilation.num_compiled_programs == 0
    app = create_app(AsyncEngine(engine, precompile=True), served_model_name="m")
    with driven(app) as call:
        deadline = time.monotonic() + 120
        while (health := call("GET", "/health")).status_code != 200:
            assert health.json()["status"] == "starting" and time.monotonic() < deadline
            time.sleep(0.1)
        compiled = engine.runner.compilation.compiled_keys
        assert compiled == frozenset(engine.program_keys())
        rng = random.Random(0)
        for length in (1, 5, 9, 17, 23, 40):
            body = {"model": "m", "prompt": [rng.randrange(3, 200) for _ in range(length)], "max_tokens": 3,
                    "temperature": rng.choice([0.0, 0.9]), "logprobs": rng.choice([None, 2]),
                    "stream": rng.random() < 0.5}
            assert call("POST", "/v1/completions", json=body).status_code == 200
        assert engine.runner.compilation.compiled_keys == compiled
