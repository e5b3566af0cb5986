"""A real uvicorn server on loopback over the fake engine: disconnects and the official client."""

import asyncio
import time

import httpx
import openai
import pytest

from orca_jax.server.app import create_app

from tests.helpers.server import FakeEngine, expected_text, live_server, wait_until

pytestmark = pytest.mark.anyio


STEP_SECONDS = 0.02


@pytest.fixture
def served():
    engine = FakeEngine(step_seconds=STEP_SECONDS, max_model_len=512, num_pages=1024)
    with live_server(create_app(engine, served_model_name="fake")) as server:
        yield engine, server


async def test_streaming_client_disconnect_aborts_within_an_iteration(served):
    engine, server = served
    async with httpx.AsyncClient(base_url=server.url) as client:
        body = {"prompt": "hello", "max_tokens": 300, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            closed_at, iteration_at_close = time.monotonic(), engine.num_iterations
        await wait_until(lambda: engine.aborted, timeout=2.0)
        latency = time.monotonic() - closed_at
        assert engine.stats().kv_pages_used == 0 and not engine.has_unfinished()
        # Freed before the next iteration could start (one may have been under way at the close).
        assert engine.aborted_at_iteration[engine.aborted[0]] <= iteration_at_close + 1
        assert latency < 0.5  # the request itself would run 300 * 20 ms = 6 s
        assert (await client.get("/health")).status_code == 200


async def test_non_streaming_client_disconnect_aborts(served):
    engine, server = served
    async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):  # we give up after 0.3 s and close the connection
            await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 300})
    await wait_until(lambda: engine.aborted, timeout=2.0)
    assert engine.stats().kv_pages_used == 0 and not engine.has_unfinished()


async def test_disconnect_while_waiting_in_the_queue_aborts():
    engine = FakeEngine(step_seconds=STEP_SECONDS, max_num_seqs=1, max_model_len=512, num_pages=1024)
    with live_server(create_app(engine)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 40},
                                                      timeout=10))
            await asyncio.sleep(0.1)
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 40})
            await wait_until(lambda: engine.aborted, timeout=2.0)
            assert engine.stats().num_waiting == 0  # left the queue before ever running
            assert (await running).json()["choices"][0]["text"] == expected_text("a", 40)


def test_official_openai_client_against_the_fake(served):
    _, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="fake", prompt="hello", max_tokens=4, temperature=0)
    assert completion.choices[0].text == "pqrs" and completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3)
    assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].message.content) == 3
    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="fake", prompt="x", top_p=5)
    assert raised.value.body["param"] == "top_p"


async def test_disconnected_requests_count_as_aborted(served):
    engine, server = served
    async with httpx.AsyncClient(base_url=server.url) as client:
        body = {"prompt": "hello", "max_tokens": 300, "stream": True, "n": 2}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        await wait_until(lambda: len(engine.aborted) == 2, timeout=2.0)
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 300}, timeout=0.2)
        await wait_until(lambda: len(engine.aborted) == 3, timeout=2.0)
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        text = (await client.get("/metrics")).text
    assert 'orca_jax:request_success_total{finished_reason="abort",model_name="fake"} 3.0' in text
    assert 'orca_jax:request_success_total{finished_reason="length",model_name="fake"} 1.0' in text


def test_official_openai_client_gets_n_choices_and_prompt_lists(served):
    _, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="fake", prompt=["ab", "xyz"], max_tokens=2, n=2)
    assert [(c.index, c.text) for c in completion.choices] == [(0, "cd"), (1, "cd"), (2, "ab"), (3, "ab")]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="fake", prompt="x", best_of=3)
    assert raised.value.body["param"] == "best_of"
    # An unknown field is ignored (and logged), as vLLM does: a misspelt max_tokens falls back to 16.
    ignored = client.completions.create(model="fake", prompt="x", extra_body={"max_token": 3})
    assert ignored.usage.completion_tokens == 16
