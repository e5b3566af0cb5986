"""Data-parallel replicas behind one front end (`--data-parallel-size`): a conversation's turns go to the
replica holding its prefix, new conversations spread, the server reads all replicas as one (and /metrics
each one too), and one replica's death fails the server as one engine's would."""

import functools
import os
import signal
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_jax.engine import EngineStats
from orca_jax.engine.replicas import replica_devices
from orca_jax.server.app import create_app
from orca_jax.server.metrics import PREFIX
from orca_jax.server.data_parallel import DataParallelEngine, start_replicas
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy
from tests.helpers.server import FakeEngine, asgi_client, wait_until


def _fake_core() -> ProcessEngine:
    return ProcessEngine(functools.partial(FakeEngine, step_seconds=0.01, max_model_len=512, num_pages=1024))


def test_stats_are_summed_and_per_iteration_figures_the_largest():
    a = EngineStats(iterations=3, num_running=2, kv_pages_total=10, last_iteration_seconds=0.5, peak_in_flight=2)
    b = EngineStats(iterations=5, num_running=1, kv_pages_total=10, last_iteration_seconds=0.2, peak_in_flight=1)
    total = EngineStats.summed([a, b])
    assert (total.iterations, total.num_running, total.kv_pages_total) == (8, 3, 20)
    assert (total.last_iteration_seconds, total.peak_in_flight) == (0.5, 2)


def test_each_replica_gets_its_slice_of_the_visible_gpus():
    assert [replica_devices(None, r, 2) for r in range(3)] == ["0,1", "2,3", "4,5"]
    assert [replica_devices("4,5,6,7", r, 2) for r in range(2)] == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="too few"):
        replica_devices("0,1,2", 1, 2)


@pytest.mark.anyio
async def test_a_conversation_s_turns_go_to_one_replica_and_another_s_to_the_other():
    replicas = start_replicas([_fake_core, _fake_core])
    engine = DataParallelEngine(replicas)
    turns = {"a": list(range(10, 22)), "b": list(range(40, 52))}  # 3 pages of 4 tokens each

    def served_prompt_tokens():
        return [stats.prompt_tokens_total for stats in engine.replica_stats]

    async with asgi_client(create_app(engine, served_model_name="fake")) as client:
        assert (await client.get("/health")).status_code == 200
        where = {}
        for turn in range(3):
            for chat, prompt in turns.items():
                before = served_prompt_tokens()
                answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert answer.status_code == 200, answer.text
                await wait_until(lambda: served_prompt_tokens() != before)
                (replica,) = [r for r in range(2) if served_prompt_tokens()[r] != before[r]]
                assert where.setdefault(chat, replica) == replica, (chat, turn)
                prompt += [7, 8, 9, 10, 11, 12]  # the reply and the next question: the same prefix, longer
        assert where["a"] != where["b"]
        assert engine.router.affinity_hits == 4
        metrics = (await client.get("/metrics")).text
        line = next(m for m in metrics.splitlines() if m.startswith(PREFIX + "prompt_tokens_total{"))
        assert float(line.split()[-1]) == sum(served_prompt_tokens()) == 2 * 12 + 2 * 18 + 2 * 24
    engine.shutdown(timeout=5)


def _samples(metrics_text: str, name: str) -> dict[str | None, float]:
    """One metric's values by their replica label (None: a series without one)."""
    [family] = [f for f in text_string_to_metric_families(metrics_text) if f.name == PREFIX + name]
    return {s.labels.get("replica"): s.value for s in family.samples if s.name in (family.name, family.name + "_total")}


@pytest.mark.anyio
async def test_metrics_show_each_replica_and_all_of_them():
    engine = DataParallelEngine(start_replicas([_fake_core, _fake_core]))
    async with asgi_client(create_app(engine, served_model_name="fake")) as client:
        for prompt in (list(range(10, 22)), list(range(40, 52)), list(range(70, 78))):  # two replicas' worth
            answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
            assert answer.status_code == 200, answer.text
        await wait_until(lambda: sum(s.generated_tokens_total for s in engine.replica_stats) == 9)
        text = (await client.get("/metrics")).text
        each = engine.replica_stats
        assert all(stats.generated_tokens_total for stats in each)  # both replicas served
        for name, field in (("prompt_tokens", "prompt_tokens_total"), ("generation_tokens", "generated_tokens_total"),
                            ("iterations", "iterations"), ("prefix_cache_queries", "prefix_cache_queries"),
                            ("prefix_cache_hits", "prefix_cache_hits"), ("num_requests_running", "num_running"),
                            ("num_requests_waiting", "num_waiting"), ("kv_cache_total_pages", "kv_pages_total"),
                            ("kv_cache_used_pages", "kv_pages_used")):
            values = _samples(text, name)
            assert set(values) == {"all", "0", "1"}, (name, values)
            assert [values["0"], values["1"]] == [getattr(stats, field) for stats in each], name
            assert values["all"] == values["0"] + values["1"], name
        assert _samples(text, "prompt_tokens")["all"] == 12 + 12 + 8
        usage = _samples(text, "kv_cache_usage_perc")  # the pooled fraction, not a sum
        assert usage["all"] == sum(s.kv_pages_reserved for s in each) / sum(s.kv_pages_total for s in each)
        assert set(_samples(text, "num_requests_in_flight")) == {None}  # the front end's count: one series
    engine.shutdown(timeout=5)


@pytest.mark.anyio
async def test_one_engine_s_metrics_have_no_replica_label():
    async with asgi_client(create_app(FakeEngine(), served_model_name="fake")) as client:
        text = (await client.get("/metrics")).text
    assert "replica=" not in text and set(_samples(text, "iterations")) == {None}


@pytest.mark.anyio
async def test_one_replica_dying_fails_the_server_once():
    failures = []
    engine = DataParallelEngine(start_replicas([_fake_core, _fake_core]), on_failure=failures.append)
    async with asgi_client(create_app(engine, served_model_name="fake")) as client:
        assert (await client.get("/health")).status_code == 200
        os.kill(engine.replicas[1].process.pid, signal.SIGKILL)
        await wait_until(lambda: failures, timeout=5)
        health = await client.get("/health")
        assert health.status_code == 503 and "engine core process died" in health.json()["reason"]
    assert len(failures) == 1
    engine.shutdown(timeout=5)


@pytest.mark.slow
def test_serve_with_two_replicas_starts_and_serves():
    port = free_port()
    process = OutputDrained([sys.executable, "-m", "orca_jax.serve", "--port", str(port), *TINY_SERVER,
                             "--data-parallel-size", "2"], cwd=ROOT, env=checkout_env())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, timeout=300)
        for prompt in ("hello there", "another prompt"):
            answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                                timeout=60)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(url + "/metrics", timeout=10).text
        line = next(m for m in metrics.splitlines() if m.startswith(PREFIX + "kv_cache_total_pages{"))
        assert float(line.split()[-1]) == 2 * 7  # --num-kv-pages 8 per replica, less its scratch page
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output
