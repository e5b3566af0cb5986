"""The HTTP API over the fake engine: bodies, errors, auth, limits, health and metrics."""

import asyncio
import contextlib
import functools
import json
import threading

import pytest

from orca_jax.server.app import create_app
from orca_jax.server.async_engine import AsyncEngine
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.api_servers import api_servers
from tests.helpers.server import FakeEngine, asgi_client, expected_text, parse_sse, wait_until

pytestmark = pytest.mark.anyio
_ENGINE_KWARGS = ("max_num_seqs", "max_waiting", "max_model_len", "step_seconds", "num_pages", "fail_at_iteration")


@pytest.fixture(params=["thread", "process"])
def mode(request) -> str:
    """Where the fake engine runs: on the server's engine thread, or as the engine core in a child process."""
    return request.param


@pytest.fixture(params=["thread", "process", "api_servers"])
def any_mode(request) -> str:
    """mode's, and two API server processes over the engine core (`serve --api-server-count 2`)."""
    return request.param


@pytest.fixture(scope="module")
def api_servers_pool():
    """Running API servers by their settings, started at first use and shared by the tests that use the same."""
    running = {}
    with contextlib.ExitStack() as stack:
        def get(engine_kwargs: dict, app_kwargs: dict):
            key = json.dumps([engine_kwargs, app_kwargs], sort_keys=True)
            if key not in running:
                running[key] = stack.enter_context(api_servers(engine_kwargs, app_kwargs, engine=FakeEngine))
            return running[key]

        yield get


@contextlib.asynccontextmanager
async def _serving(mode: str, pool, **kwargs):
    """A client of _app(mode, **kwargs); in "api_servers" mode, of two API server processes over the
    same engine core, as serve runs them (one connection: requests in sequence reach one of them)."""
    if mode != "api_servers":
        async with asgi_client(_app(mode, **kwargs)) as client:
            yield client
        return
    engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_KWARGS}
    async with pool(engine_kwargs, kwargs).client(with_key=False) as client:  # the tests send their own
        yield client


def _app(mode: str = "thread", *, max_in_flight: int | None = None, **kwargs):
    engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_KWARGS}
    if mode == "process":
        engine = ProcessEngine(functools.partial(FakeEngine, **engine_kwargs), max_in_flight=max_in_flight)
    else:
        engine = AsyncEngine(FakeEngine(**engine_kwargs), max_in_flight=max_in_flight)
    return create_app(engine, **kwargs)


async def _post(client, path, body):
    # json.dumps escapes lone surrogates ("\\ud800") as a JSON text may; httpx's json= cannot send them.
    return await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


async def test_completion_text_usage_and_finish_reason(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "hello",
                                                              "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == expected_text("hello", 5) == "pqrst"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


async def test_completion_accepts_token_ids_and_a_one_prompt_list(mode):
    async with asgi_client(_app(mode)) as client:
        by_ids = await client.post("/v1/completions", json={"prompt": list(b"abc"), "max_tokens": 3})
        by_list = await client.post("/v1/completions", json={"prompt": ["abc"], "max_tokens": 3})
    assert by_ids.json()["choices"][0]["text"] == by_list.json()["choices"][0]["text"] == "def"


async def test_stop_string_finishes_with_stop(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool) as client:
        response = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10, "stop": ["e"]})
    choice = response.json()["choices"][0]
    assert choice["text"] == "bcd" and choice["finish_reason"] == "stop"


async def test_chat_uses_the_chat_template_and_reports_usage():
    engine = FakeEngine()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}], add_generation_prompt=True)
    async with asgi_client(create_app(engine)) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"model": "fake", "messages": messages, "max_completion_tokens": 4})
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text(prompt, 4)}
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    assert body["usage"]["completion_tokens"] == 4


async def test_chat_default_max_tokens_fills_the_context(mode):
    async with asgi_client(_app(mode, max_model_len=64)) as client:
        response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    usage = response.json()["usage"]
    assert usage["total_tokens"] == 64 and response.json()["choices"][0]["finish_reason"] == "length"


async def test_streamed_completion_chunks_and_usage(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool) as client:
        response = await client.post("/v1/completions", json={
            "prompt": "hello", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "pqrs"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


async def test_streamed_chat_follows_openai_chunk_format(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {"content": chunks[-1]["choices"][0]["delta"]["content"]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 3


async def test_logprobs_in_both_endpoints(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool) as client:
        completion = (await client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 2, "logprobs": 2})).json()
        chat = (await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2})).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["b", "c"] and logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"b": -0.5, "c": -1.5} and logprobs["text_offset"] == [0, 1]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["bytes"] == list(content[0]["token"].encode())
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]


async def test_models_endpoint_and_unknown_model(mode):
    async with asgi_client(_app(mode, served_model_name="my-model")) as client:
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "my-model"
        assert (await client.get("/v1/models/my-model")).status_code == 200
        _assert_openai_error(await client.get("/v1/models/other"), 404, "model")
        _assert_openai_error(await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}),
                             404, "model")
        _assert_openai_error(await client.get("/v1/nothing-here"), 404)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2**40}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["ok", "bad \udfff"]}, "prompt"),
    ({"prompt": "x", "stop": ["\ud800"]}, "stop"),
    ({"prompt": "x", "stream": True, "user": "\udc00"}, "user"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": [1, 300]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": [""]}, "bad_words"),
    ({"prompt": "x", "echo": True, "logprobs": 0}, "echo"),  # prompt logprobs are not enabled
    ({"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, None),
    ({"prompt": "x", "response_format": {"type": "json"}}, "response_format"),
    ({"prompt": "x", "guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": "x", "guided_regex": "("}, "guided_regex"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "object", "minProperties": "two"}}},
     "structured_outputs"),
    ({"prompt": "x", "priority": 2**40}, "priority"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 300]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [[1], [300]]}, "prompt"),
    ({}, "prompt"),
])
async def test_invalid_completion_fields_are_400_naming_the_param(body, param):
    async with asgi_client(_app()) as client:
        _assert_openai_error(await _post(client, "/v1/completions", body), 400, param)


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}], "stream": True}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    # (tools without tool_choice are "auto", answered by default: tests/server/test_tools_default.py)
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [_TOOL], "tool_choice": "required",
      "guided_json": {"type": "object"}}, "guided_json"),
])
async def test_invalid_chat_fields_are_400(body, param):
    async with asgi_client(_app()) as client:
        _assert_openai_error(await _post(client, "/v1/chat/completions", body), 400, param)


async def test_malformed_json_and_wrong_shapes_are_400():
    async with asgi_client(_app()) as client:
        for content in (b"{not json", b"[1, 2]", b"null", b'"prompt"', b"", b"\xff\xfe"):
            response = await client.post("/v1/completions", content=content,
                                         headers={"content-type": "application/json"})
            _assert_openai_error(response, 400)
        _assert_openai_error(await client.post("/v1/completions", content=b"NaN",
                                               headers={"content-type": "application/json"}), 400)
        _assert_openai_error(await client.post("/v1/completions", content=b'{"prompt": "x", "top_p": NaN}',
                                               headers={"content-type": "application/json"}), 400, "top_p")
        _assert_openai_error(await client.get("/v1/completions"), 405)


async def test_prompt_longer_than_the_model_allows_is_400(mode):
    async with asgi_client(_app(mode, max_model_len=32)) as client:
        too_long = await client.post("/v1/completions", json={"prompt": "x" * 40})
        no_room = await client.post("/v1/completions", json={"prompt": "x" * 20, "max_tokens": 20})
        chat = await client.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "x" * 40}]})
    _assert_openai_error(too_long, 400, "prompt")
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    _assert_openai_error(no_room, 400, "prompt")
    _assert_openai_error(chat, 400, "messages")


async def test_body_limit_is_413_before_parsing():
    async with asgi_client(_app(max_body_bytes=1000)) as client:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        _assert_openai_error(await client.post("/v1/completions", content=big,
                                               headers={"content-type": "application/json"}), 413)

        async def chunked():  # no Content-Length: the limit counts the bytes as they come
            yield big[:500]
            yield big[500:]

        _assert_openai_error(await client.post("/v1/completions", content=chunked(),
                                               headers={"content-type": "application/json"}), 413)
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


async def test_api_key_guards_v1_but_not_health(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool, api_key="s3cret") as client:
        body = {"prompt": "x", "max_tokens": 1}
        _assert_openai_error(await client.post("/v1/completions", json=body), 401)
        _assert_openai_error(await client.post("/v1/completions", json=body,
                                               headers={"Authorization": "Bearer wrong"}), 401)
        _assert_openai_error(await client.get("/v1/models", headers={"Authorization": "s3cret"}), 401)
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_metrics_can_require_the_key():
    async with asgi_client(_app(api_key="k", metrics_require_auth=True)) as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer k"})).status_code == 200


async def test_metrics_report_engine_and_latencies(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool, served_model_name="m") as client:
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        text = (await client.get("/metrics")).text
    # vLLM's names with our prefix, every series labelled with the model.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_cache_used_pages", "kv_cache_total_pages", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "iteration_seconds_bucket", "batch_size_bucket", "iteration_tokens_total_bucket",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "iterations_total",
                 "host_seconds_total", "device_wait_seconds_total", "batched_requests_total"):
        assert f"orca_jax:{name}{{" in text, name
    assert 'orca_jax:prompt_tokens_total{model_name="m"} 5.0' in text
    assert 'orca_jax:generation_tokens_total{model_name="m"} 3.0' in text
    assert 'orca_jax:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    assert 'orca_jax:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'orca_jax:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'orca_jax:request_generation_tokens_sum{model_name="m"} 3.0' in text
    assert 'orca_jax:kv_cache_usage_perc{model_name="m"} 0.0' in text  # all freed again


async def test_kv_cache_usage_counts_used_and_reserved_pages():
    engine = FakeEngine(num_pages=100, page_size=4, step_seconds=0.02)
    async with asgi_client(create_app(engine, served_model_name="m")) as client:
        request = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 36}))
        await wait_until(lambda: engine.num_iterations > 0)
        text = (await client.get("/metrics")).text
        await request
    # The fake reserves (4 + 36) / 4 = 10 of 100 pages as soon as the request runs.
    assert 'orca_jax:kv_cache_usage_perc{model_name="m"} 0.1' in text


async def test_two_apps_keep_separate_metrics():
    first, second = _app(), _app()
    async with asgi_client(first) as client:
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    async with asgi_client(second) as client:
        text = (await client.get("/metrics")).text
    assert 'orca_jax:generation_tokens_total{model_name="fake"} 0.0' in text


async def test_queue_full_is_503_with_retry_after(any_mode, api_servers_pool):
    # The engine's own bound decides.
    # (API server processes bound their own in flight at the engine's pool, max_waiting + max_num_seqs.)
    kwargs = {} if any_mode == "api_servers" else {"max_in_flight": 100}
    async with _serving(any_mode, api_servers_pool, max_num_seqs=1, max_waiting=1, step_seconds=0.05,
                        **kwargs) as client:
        responses = await asyncio.gather(*(
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}) for _ in range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses
    for response in responses:
        if response.status_code == 503:
            _assert_openai_error(response, 503)
            assert response.headers["retry-after"] == "1"


async def test_own_in_flight_bound_is_503_with_retry_after(mode):
    app = _app(mode, step_seconds=0.05, max_in_flight=2)
    async with asgi_client(app) as client:
        responses = await asyncio.gather(*(
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}) for _ in range(5)))
    assert sorted(r.status_code for r in responses) == [200, 200, 503, 503, 503]
    assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 503)


async def test_health_follows_the_engine_loop(mode):
    app = _app(mode, fail_at_iteration=0)
    assert app.state.async_engine.is_healthy is False  # lifespan not started yet
    async with asgi_client(app) as client:
        assert (await client.get("/health")).status_code == 200
        failed = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        _assert_openai_error(failed, 503)
        health = await client.get("/health")
        assert health.status_code == 503 and "failed" in health.json()["reason"]
        _assert_openai_error(await client.post("/v1/completions", json={"prompt": "x"}), 503)


async def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(any_mode, api_servers_pool):
    async with _serving(any_mode, api_servers_pool, fail_at_iteration=2) as client:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True})
    events = parse_sse(response.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["y", "z"]
    assert events[2]["error"]["type"] == "service_unavailable_error" and events[3] == "[DONE]"


async def test_on_ready_runs_once_after_compiling_and_before_health_says_ok():
    engine = FakeEngine()
    engine.compile_gate = threading.Event()
    ready_when_called = []
    async_engine = AsyncEngine(engine, precompile=True,
                               on_ready=lambda: ready_when_called.append(async_engine.readiness.ready))
    async with asgi_client(create_app(async_engine)) as client:
        await asyncio.sleep(0.05)
        assert ready_when_called == []  # still compiling
        engine.compile_gate.set()
        while (await client.get("/health")).status_code != 200:
            await asyncio.sleep(0.01)
        assert ready_when_called == [False]  # once, before readiness flipped


async def test_health_says_what_start_up_waits_for_and_requests_wait_for_it():
    """With precompile, /health is 503 "starting" (naming the compile progress) until every program is
    compiled; a request sent meanwhile waits and is then served."""
    engine = FakeEngine()
    engine.compile_gate = threading.Event()
    app = create_app(AsyncEngine(engine, precompile=True))
    async with asgi_client(app) as client:
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        assert "starting" in health.json()["waiting_for"] or "compiling" in health.json()["waiting_for"]
        early = asyncio.create_task(client.post("/v1/completions", json={"model": "fake", "prompt": "hi",
                                                                         "max_tokens": 2}))
        await asyncio.sleep(0.05)
        assert not early.done()  # queued behind the compilation
        engine.compile_gate.set()
        assert (await early).status_code == 200
        health = await client.get("/health")
        assert health.status_code == 200, health.json()
