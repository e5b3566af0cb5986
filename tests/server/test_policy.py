"""Deadlines, priorities and their metrics through the HTTP server over the real tiny engine."""

import asyncio
import json

import pytest

from orca_jax.config import SchedulingPolicy
from orca_jax.server.app import create_app

from tests.helpers.engines import tiny_engine
from tests.helpers.server import asgi_client, parse_sse, wait_until


# One request at a time, so a second one waits behind the first (tiny_engine's arguments).
ONE_AT_A_TIME = dict(page_size=16, num_pages=64, max_num_seqs=1, max_num_batched_tokens=8,
                     scheduler_options=dict(policy=SchedulingPolicy.FCFS))


async def _post(client, body):
    return await client.post("/v1/completions", content=json.dumps(body),
                             headers={"content-type": "application/json"})


@pytest.mark.anyio
async def test_request_still_waiting_at_its_deadline_is_dropped_504_or_error_event():
    app = create_app(tiny_engine(**ONE_AT_A_TIME), served_model_name="tiny")
    async with asgi_client(app) as client:
        async_engine = app.state.async_engine
        blocker = asyncio.create_task(_post(client, {"prompt": "hold the batch", "max_tokens": 120,
                                                     "ignore_eos": True, "temperature": 0}))
        await wait_until(lambda: async_engine.latest_stats.num_running >= 1, timeout=60)
        late = await _post(client, {"prompt": "too late", "max_tokens": 4, "deadline_ms": 1, "priority": 3})
        assert late.status_code == 504, late.text
        error = late.json()["error"]
        assert error["code"] == "deadline_exceeded" and error["param"] == "deadline_ms"
        streamed = await _post(client, {"prompt": "too late", "max_tokens": 4, "deadline_ms": 1,
                                        "stream": True})
        events = parse_sse(streamed.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "deadline_exceeded"
        assert (await blocker).status_code == 200
        ok = await _post(client, {"prompt": "in time", "max_tokens": 2, "deadline_ms": 60_000,
                                  "priority": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        text = (await client.get("/metrics")).text
        assert 'orca_jax:deadline_misses_total{model_name="tiny"} 2.0' in text
        assert 'orca_jax:deadline_hits_total{model_name="tiny"} 1.0' in text
        assert 'orca_jax:num_preemptions_total{model_name="tiny"} 0.0' in text
        assert 'orca_jax:request_queue_time_seconds_count{model_name="tiny",priority="3"} 1.0' in text
        assert async_engine.latest_stats.deadline_misses == 2


def test_serve_flags_for_policies_and_kv_allocation():
    from orca_jax.config import KVAllocation
    from orca_jax.serve import build_parser, engine_config_from_args

    config = engine_config_from_args(build_parser().parse_args([])).scheduler
    assert (config.policy, config.kv_allocation, config.priority_preemption) == (
        SchedulingPolicy.PRIORITY, KVAllocation.ON_DEMAND, True)
    config = engine_config_from_args(build_parser().parse_args(
        ["--scheduling-policy", "das", "--kv-allocation", "reserve", "--no-priority-preemption",
         "--priority-aging-s", "3"])).scheduler
    assert (config.policy, config.kv_allocation, config.priority_preemption, config.priority_aging_s) == (
        SchedulingPolicy.DAS, KVAllocation.RESERVE, False, 3.0)
