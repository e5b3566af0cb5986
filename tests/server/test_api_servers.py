"""Several API server processes in front of the engine cores (`serve --api-server-count N`): one server
from outside. A conversation's turns reach the replica holding its prefix whichever API server takes
them; /metrics' totals are what the clients received, from either; an adapter load or a prefix-cache
reset reaches each core once and every API server sees the adapters; a dead API server or core ends the
server within seconds; combinations that cannot work are refused at start with one line."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_jax.server.api_servers import default_api_server_count
from orca_jax.server.app import create_app
from orca_jax.server.metrics import PREFIX

from tests.helpers.api_servers import api_servers
from tests.helpers.lora import write_llama_adapter
from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy
from tests.helpers.server import FakeEngine, asgi_client, parse_sse

pytestmark = pytest.mark.anyio
ENGINE = {"step_seconds": 0.005, "max_model_len": 512, "num_pages": 1024}


MAX_BODY_BYTES = 20_000


@pytest.fixture(scope="module")
def two_replicas():
    """Two API servers over two replicas, behind a key, shared by the tests that leave it as they found it."""
    with api_servers(ENGINE, {"served_model_name": "fake", "api_key": "k3y", "max_body_bytes": MAX_BODY_BYTES},
                     replicas=2) as running:
        yield running


async def test_the_key_and_the_body_limit_hold_in_every_api_server(two_replicas):
    for index in range(2):
        keyless = await two_replicas.client_of(index, with_key=False)
        assert (await keyless.get("/v1/models")).status_code == 401
        assert (await keyless.get("/health")).status_code == 200
        await keyless.aclose()
        client = await two_replicas.client_of(index)
        too_big = await client.post("/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES})
        assert too_big.status_code == 413, too_big.text
        await client.aclose()


def _values(metrics_text: str, name: str) -> dict:
    """One metric's samples: {(sample name, frozenset of its labels but model_name): value}."""
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for f in text_string_to_metric_families(metrics_text) if f.name == PREFIX + name for s in f.samples}


def _value(metrics_text: str, name: str, sample: str | None = None, **labels) -> float:
    """A sample's value; 0 for a labelled series not yet counted (a counter by finish reason before any)."""
    return _values(metrics_text, name).get((PREFIX + (sample or name), frozenset(labels.items())), 0.0)


async def _totals(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's totals as one API server's /metrics gives them."""
    text = (await client.get("/metrics")).text
    return {"generated": _value(text, "generation_tokens", "generation_tokens_total", replica="all"),
            "generation_sum": _value(text, "request_generation_tokens", "request_generation_tokens_sum"),
            "finished": _value(text, "request_success", "request_success_total", finished_reason="length"),
            "token_gaps": _value(text, "inter_token_latency_seconds", "inter_token_latency_seconds_count"),
            "first_tokens": _value(text, "time_to_first_token_seconds", "time_to_first_token_seconds_count"),
            "in_flight": _value(text, "num_requests_in_flight"),
            "iterations": _value(text, "iterations", "iterations_total", replica="all"),
            "iteration_seconds": _value(text, "iteration_seconds", "iteration_seconds_count")}


async def _until(condition, timeout: float = 10.0):
    """Poll an async condition (the test's; the server never polls) until it holds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_one_api_server_unless_replicas_have_cpu_cores_to_spare():
    assert default_api_server_count(1, 64) == 1
    assert default_api_server_count(1, 16, gpu=True) == 4  # one engine on a GPU: measured 0.97 of in-process
    assert default_api_server_count(1, 6, gpu=True) == 1
    assert default_api_server_count(4, 64) == 4
    assert default_api_server_count(4, 4) == 2
    assert default_api_server_count(2, 2) == 1


async def test_a_conversation_s_turns_reach_one_replica_whichever_api_server_takes_them(two_replicas):
    clients = [await two_replicas.client_of(i) for i in range(2)]
    metrics = two_replicas.client()

    async def prompt_tokens_per_replica() -> list[float]:
        text = (await metrics.get("/metrics")).text
        return [_value(text, "prompt_tokens", "prompt_tokens_total", replica=str(r)) for r in range(2)]

    async def replica_of(send, prompt: list[int], before: list[float] | None = None) -> int:
        """Which replica took the prompt `send()` sends (its prompt tokens counted there since `before`)."""
        before = before or await prompt_tokens_per_replica()
        await send()

        async def counted() -> bool:
            return sum(await prompt_tokens_per_replica()) == sum(before) + len(prompt)

        await _until(counted)
        after = await prompt_tokens_per_replica()
        (replica,) = [r for r in range(2) if after[r] != before[r]]
        return replica

    async def complete(client: httpx.AsyncClient, prompt: list[int]) -> None:
        answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 200, answer.text

    turns = {"a": list(range(10, 22)), "b": list(range(40, 52))}  # 3 pages of 4 tokens each
    body = {"prompt": turns["a"], "max_tokens": 300, "stream": True}
    before = await prompt_tokens_per_replica()
    async with clients[0].stream("POST", "/v1/completions", json=body) as streaming:  # in flight on its replica...
        lines = streaming.aiter_lines()
        where = {"a": await replica_of(lambda: anext(lines), turns["a"], before)}
        # ... which counts in API server 1's routing: a new conversation goes to the other replica.
        where["b"] = await replica_of(lambda: complete(clients[1], turns["b"]), turns["b"])
        assert where["b"] != where["a"]
    for turn in range(1, 5):
        for chat, prompt in turns.items():
            prompt += [7, 8, 9, 10, 11, 12]  # the reply and the next question: the same prefix, longer
            client = clients[(turn + (chat == "b")) % 2]  # each chat alternates API servers
            assert await replica_of(lambda: complete(client, prompt), prompt) == where[chat], (chat, turn)
    for client in (*clients, metrics):
        await client.aclose()


async def test_metrics_totals_are_what_the_clients_received_whichever_api_server_answers(two_replicas):
    clients = [await two_replicas.client_of(i) for i in range(2)]
    before = await _totals(clients[0])
    received, requests = 0, 0
    for index, client in enumerate(clients):
        for max_tokens in (3, 5, 8):
            streamed = await client.post("/v1/completions", json={
                "prompt": f"hello {index}", "max_tokens": max_tokens, "stream": True})
            received += len([e for e in parse_sse(streamed.text)[:-1] if e["choices"][0]["text"]])
            whole = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
            received += whole.json()["usage"]["completion_tokens"]
            requests += 2
    assert received == 2 * 2 * (3 + 5 + 8)
    for client in clients:  # each answers for the server (the engine's counters: once the cores' next report came)
        async def settled() -> bool:
            return (await _totals(client))["generated"] - before["generated"] == received

        await _until(settled)
        after = await _totals(client)
        assert after["generation_sum"] - before["generation_sum"] == received
        assert after["finished"] - before["finished"] == requests
        assert after["token_gaps"] - before["token_gaps"] == received - requests
        assert after["first_tokens"] - before["first_tokens"] == requests
        assert after["in_flight"] == 0
        assert after["iteration_seconds"] == after["iterations"]  # each iteration observed once
    # The same series as one process gives (its *_created series aside: serve turns them off).
    async with asgi_client(create_app(FakeEngine(), served_model_name="fake")) as alone:
        assert (await alone.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})).status_code == 200
        one = {s.name for f in text_string_to_metric_families((await alone.get("/metrics")).text)
               for s in f.samples if not s.name.endswith("_created")}
    several = {s.name for f in text_string_to_metric_families((await clients[0].get("/metrics")).text)
               for s in f.samples}
    assert several == one, several ^ one
    for client in clients:
        await client.aclose()


async def test_adapters_and_prefix_cache_resets_reach_each_core_once_and_every_api_server_sees_them(
        two_replicas, tmp_path):
    write_llama_adapter(tmp_path / "sql")
    first, second = [await two_replicas.client_of(i) for i in range(2)]
    loaded = await first.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path / "sql")})
    assert loaded.status_code == 200, loaded.text  # a second add in any core would have been refused

    async def listed_by_both() -> bool:
        listed = [[m["id"] for m in (await c.get("/v1/models")).json()["data"]] for c in (first, second)]
        return all("sql" in ids for ids in listed)

    await _until(listed_by_both)
    answer = await second.post("/v1/completions", json={"model": "sql", "prompt": "a", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "sql"
    again = await second.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path / "sql")})
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_already_loaded"
    assert (await second.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})).status_code == 200

    async def gone_from_both() -> bool:
        statuses = [(await c.post("/v1/completions", json={"model": "sql", "prompt": "a"})).status_code
                    for c in (first, second)]
        return statuses == [404, 404]

    await _until(gone_from_both)
    reset = (await first.post("/reset_prefix_cache")).json()
    assert reset["pages_forgotten"] == 2  # each of the two cores forgot its one page, once
    for client in (first, second):
        await client.aclose()


@pytest.mark.parametrize("victim", ["API server", "engine core"])
async def test_a_dead_api_server_or_core_fails_health_and_the_server_exits_one_within_seconds(victim):
    with api_servers(ENGINE, {"served_model_name": "fake"}) as running:
        process = (running.servers.api_servers[1] if victim == "API server" else running.servers.cores[0])
        os.kill(process.pid, signal.SIGKILL)
        killed_at = time.monotonic()

        async def health_fails() -> bool:
            try:
                async with httpx.AsyncClient(base_url=running.url, timeout=5) as client:
                    return (await client.get("/health")).status_code != 200
            except httpx.TransportError:  # every API server has stopped: nobody accepts
                return True

        await _until(health_fails, timeout=10)
        assert await running.wait_exited(10) == 1
        assert time.monotonic() - killed_at < 10


def _serve(*flags: str, **env: str) -> subprocess.Popen:
    return OutputDrained([sys.executable, "-m", "orca_jax.serve", *flags], cwd=ROOT, env=checkout_env(**env))


def test_fine_tuning_with_several_api_servers_is_refused_with_one_line():
    process = _serve("--port", str(free_port()), *TINY_SERVER, "--enable-fine-tuning", "--api-server-count", "2")
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 2, output
    assert output.strip().splitlines()[-1].endswith("keep their files and jobs in one process: start with "
                                                    "--api-server-count 1"), output
    assert "Traceback" not in output


@pytest.mark.slow
def test_serve_with_two_api_servers_over_two_tensor_parallel_replicas_of_fake_devices():
    """`--data-parallel-size 2 --tensor-parallel-size 2` on four (fake CPU) devices, two per core, behind
    two API servers: it serves, its metrics add up the two replicas, and SIGTERM drains everything."""
    port = free_port()
    process = _serve("--port", str(port), *TINY_SERVER, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                     "--api-server-count", "2", "--log-level", "info", "--disable-uvicorn-access-log",
                     JAX_NUM_CPU_DEVICES="2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=400)
        for prompt in ("hello there", "another prompt", "a third one"):
            answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                                timeout=120)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _value(metrics, "kv_cache_total_pages", replica="all") == 2 * 7  # 8 pages per replica, less scratch
        assert _value(metrics, "request_success", "request_success_total", finished_reason="length") == 3
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output
    assert output.count("ready at") == 1, output

