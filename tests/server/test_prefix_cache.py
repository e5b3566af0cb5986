"""Prefix caching through the server: usage.prompt_tokens_details.cached_tokens (streamed too), the
prefix-cache counters in /metrics, and POST /reset_prefix_cache behind the API key."""

import functools

import httpx
import openai
import pytest

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.server.app import create_app
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.server import live_server, parse_sse

KEY = "secret"
SYSTEM = "You are a terse assistant who answers in one short sentence. " * 3  # several pages of bytes


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_resent_history_is_served_from_the_cache_and_usage_says_so(mode):
    build = functools.partial(Engine, EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=16, num_pages=256),
                                                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    engine = build() if mode == "thread" else ProcessEngine(build)  # in a child process: the core's cache
    with live_server(create_app(engine, served_model_name="tiny", api_key=KEY)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details is None  # nothing was cached yet
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # The shared history's full pages: at least the system prompt's, never the whole prompt.
        assert 16 * (len(SYSTEM) // 16) - 16 <= cached < second.usage.prompt_tokens
        assert cached % 16 == 0

        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            events = parse_sse(response.read().decode())
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached

        metrics = httpx.get(f"{server.url}/metrics").text
        hits = _metric(metrics, "prefix_cache_hits_total")
        assert _metric(metrics, "prefix_cache_queries_total") >= hits >= 2 * cached

        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
        reset = httpx.post(f"{server.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
        assert reset.status_code == 200 and reset.json()["pages_forgotten"] > 0
        third = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert third.usage.prompt_tokens_details is None  # computed again from scratch
        assert third.choices[0].message.content == second.choices[0].message.content


def _metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(f"orca_jax:{name}{{")]
    return float(line.rsplit(" ", 1)[1])
