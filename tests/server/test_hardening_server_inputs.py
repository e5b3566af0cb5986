"""Request bodies from an attacker get a 400 naming the rule, never a 500 or a dropped connection:
JSON nested past --max-json-depth in any field (known or not), NaN or Infinity anywhere (free-form
fields such as a JSON schema included), a guided_json string holding deep JSON, a Host header that
only starts like an allowed one, and bad adapters loaded over HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from orca_jax.config import LoRAConfig
from orca_jax.json_limits import MAX_DEPTH_LIMIT
from orca_jax.server.app import LOCAL_HOSTS, create_app
from orca_jax.server.cli_args import parse_args
from orca_jax.server.middleware import host_name

from tests.helpers.engines import tiny_engine
from tests.helpers.lora import write_llama_adapter
from tests.helpers.server import FakeEngine, asgi_client


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _completion(**extra) -> dict:
    return {"prompt": "abc", "max_tokens": 2, **extra}


async def _post(client, body: str | dict, path: str = "/v1/completions"):
    content = body if isinstance(body, str) else json.dumps(body)
    return await client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("depth", [65, 600, 990, 5000, 100_000])
@pytest.mark.parametrize("field", ["unknown_field", "prompt", "stop"])
def test_deep_json_in_any_field_is_a_400_naming_the_limit(field, depth):
    app = create_app(FakeEngine(), served_model_name="fake", max_body_bytes=1 << 20)

    async def scenario():
        async with asgi_client(app) as client:
            start = time.monotonic()
            body = json.dumps(_completion())[:-1] + f', "{field}": {_nested(depth)}}}'
            answer = await _post(client, body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "json_too_deep"
            assert "more than 64 levels deep" in answer.json()["error"]["message"]
            assert time.monotonic() - start < 2
            assert (await _post(client, _completion())).status_code == 200  # and the server goes on

    asyncio.run(scenario())


def test_the_deepest_the_flag_allows_is_served_or_refused_below_500():
    """At --max-json-depth's own bound every recursive walk (parsing, ours, pydantic's) still fits the stack."""
    app = create_app(FakeEngine(), served_model_name="fake", max_json_depth=MAX_DEPTH_LIMIT)

    async def scenario():
        async with asgi_client(app) as client:
            deepest = MAX_DEPTH_LIMIT - 1  # the body's object is one level
            for field in ("unknown_field", "prompt", "response_format"):
                body = json.dumps(_completion())[:-1] + f', "{field}": {_nested(deepest)}}}'
                answer = await _post(client, body)
                assert answer.status_code in (200, 400), (field, answer.status_code, answer.text[:200])
            schema = {"type": "object"}
            for _ in range(40):  # a schema nested 120 levels: deep, but a schema
                schema = {"type": "object", "properties": {"a": schema}}
            answer = await _post(client, _completion(response_format={
                "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}))
            assert answer.status_code < 500, answer.text[:200]
            too_deep = json.dumps(_completion())[:-1] + f', "x": {_nested(MAX_DEPTH_LIMIT)}}}'
            assert (await _post(client, too_deep)).status_code == 400

    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_anywhere_naming_the_field(value):
    app = create_app(FakeEngine(), served_model_name="fake")

    async def scenario():
        async with asgi_client(app) as client:
            cases = {
                "temperature": f'"temperature": {value}',
                "response_format.json_schema.schema.maximum":
                    f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "n", '
                    f'"schema": {{"type": "number", "maximum": {value}}}}}}}',
                "logit_bias.5": f'"logit_bias": {{"5": {value}}}',
                "metadata.score": f'"metadata": {{"score": {value}}}',
            }
            for field, text in cases.items():
                answer = await _post(client, json.dumps(_completion())[:-1] + ", " + text + "}")
                assert answer.status_code == 400, (field, answer.text)
                message = answer.json()["error"]["message"]
                assert message.startswith(f"{field}: {value} is not a JSON number"), (field, message)
                assert answer.json()["error"]["param"] == field.split(".")[0]

    asyncio.run(scenario())


def test_a_guided_json_string_holding_deep_json_is_a_400():
    app = create_app(FakeEngine(), served_model_name="fake")

    async def scenario():
        async with asgi_client(app) as client:
            for text in (_nested(5000), '{"type": "object", "maximum": NaN}'):
                answer = await _post(client, _completion(guided_json=text))
                assert answer.status_code == 400, answer.text
                assert "invalid json_schema" in answer.json()["error"]["message"]

    asyncio.run(scenario())


def test_a_host_header_must_be_a_host_and_a_port():
    assert host_name(b"localhost:1@evil.com") == "localhost:1@evil.com"
    assert host_name(b"localhost:8000") == "localhost" and host_name(b"LOCALHOST") == "localhost"
    assert host_name(b"[::1]:8000") == "[::1]" and host_name(b"[::1]x") == "[::1]x"
    assert host_name(b"127.0.0.1:80:80") == "127.0.0.1:80:80" and host_name(b"localhost:") == "localhost"
    app = create_app(FakeEngine(), served_model_name="fake", allowed_hosts=LOCAL_HOSTS)

    async def scenario():
        async with asgi_client(app) as client:
            for host in ("localhost:1@evil.com", "localhost:80/evil.com", "localhost:x", "evil.com"):
                answer = await client.get("/v1/models", headers={"host": host})
                assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host", host
            assert (await client.get("/v1/models", headers={"host": "localhost:8000"})).status_code == 200

    asyncio.run(scenario())


def test_max_json_depth_is_a_flag_with_a_bound():
    assert parse_args(["--max-json-depth", "100"]).max_json_depth == 100
    assert parse_args([]).max_json_depth == 64
    for bad in ("0", str(MAX_DEPTH_LIMIT + 1), "x"):
        with pytest.raises(SystemExit):
            parse_args(["--max-json-depth", bad])


def test_load_lora_adapter_refuses_non_finite_adapters_and_the_base_model_keeps_serving(tmp_path):
    """The issue's first case: lora_alpha NaN (or Infinity) was accepted, and one request on the adapter
    emptied every later request."""
    engine = tiny_engine(lora=LoRAConfig(max_loras=2, max_lora_rank=8), compilation_cache_dir=None)
    app = create_app(engine, served_model_name="tiny")
    good = tmp_path / "good"
    write_llama_adapter(good)
    bad_configs = {"alpha-nan": '"lora_alpha": NaN', "alpha-inf": '"lora_alpha": Infinity',
                   "r-nan": '"r": NaN', "alpha-huge": '"lora_alpha": 1e308'}

    async def scenario():
        async with asgi_client(app) as client:
            greedy = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            before = (await client.post("/v1/completions", json=greedy)).json()["choices"][0]["text"]
            for name, text in bad_configs.items():
                path = tmp_path / name
                write_llama_adapter(path)
                config = json.loads((path / "adapter_config.json").read_text())
                key = text.split('"')[1]
                body = json.dumps({k: v for k, v in config.items() if k != key})
                (path / "adapter_config.json").write_text(body[:-1] + ", " + text + "}")
                answer = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                assert answer.status_code == 400, (name, answer.text)
                assert answer.json()["error"]["code"] == "invalid_lora_adapter"
                assert "adapter_config.json" in answer.json()["error"]["message"]
            ok = await client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(good)})
            assert ok.status_code == 200, ok.text
            adapted = await client.post("/v1/completions", json={**greedy, "model": "good"})
            assert adapted.status_code == 200
            after = (await client.post("/v1/completions", json=greedy)).json()["choices"][0]["text"]
            assert after == before
            models = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["tiny", "good"]

    asyncio.run(scenario())
