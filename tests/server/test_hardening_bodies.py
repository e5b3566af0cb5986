"""Bad input is never a 500 (issue 47): bodies not in UTF-8 (UTF-16 passed the nesting check, then
nested 300-600 levels into a RecursionError), a lone surrogate as a key, a large body (parsed and
validated off the loop) refused exactly as a small one, duplicate Authorization or Host headers,
adapter names that read as paths or hold control characters, and the walks over client data
iterative whatever the nesting."""

from __future__ import annotations

import json

import httpx
import pytest

from orca_jax.server.app import create_app
from orca_jax.server.json_body import PARSE_OFF_LOOP_BYTES
from orca_jax.server.lora import LoadLoRAAdapterRequest
from orca_jax.server.protocol_base import StrictBody

from tests.helpers.server import FakeEngine, asgi_client

pytestmark = pytest.mark.anyio
JSON = {"content-type": "application/json"}
BODY = {"prompt": "abc", "max_tokens": 1}


def _nested(depth: int) -> str:
    return '{"prompt": "a", "max_tokens": 1, "x": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])
async def test_a_body_not_in_utf8_is_a_400(encoding):
    async with asgi_client(create_app(FakeEngine())) as client:
        answer = await client.post("/v1/completions", content=json.dumps(BODY).encode(encoding), headers=JSON)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        # UTF-16 and UTF-32 without a byte order mark are valid UTF-8 (NUL bytes and ASCII): not JSON, then.
        assert error["code"] in ("invalid_encoding", "invalid_request"), error
        assert "UTF-8" in error["message"] or "byte order mark" in error["message"] or "malformed JSON" in error["message"]
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


@pytest.mark.parametrize("depth", [300, 450, 600])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
async def test_utf16_bodies_nested_hundreds_deep_are_a_400(encoding, depth):
    async with asgi_client(create_app(FakeEngine())) as client:
        answer = await client.post("/v1/completions", content=_nested(depth).encode(encoding), headers=JSON)
        assert answer.status_code == 400, answer.text


async def test_a_lone_surrogate_as_a_key_is_named_as_such():
    async with asgi_client(create_app(FakeEngine())) as client:
        top = await client.post("/v1/completions", content=b'{"\\ud800": 1, "prompt": "a", "max_tokens": 1}',
                                headers=JSON)
        assert top.status_code == 400
        assert top.json()["error"]["message"].startswith("A field name is not valid Unicode: a lone surrogate")
        nested = await client.post("/v1/chat/completions", headers=JSON, content=(
            b'{"messages": [{"role": "user", "content": "hi", "\\udfff": 2}], "max_tokens": 1}'))
        assert nested.status_code == 400
        error = nested.json()["error"]
        assert error["message"].startswith("messages.0: a field name is not valid Unicode") and error["param"] == "messages"


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "abc", "max_tokens": 1, "metadata": {"note": "x" * PARSE_OFF_LOOP_BYTES}}, 200, None),  # ignored
    ({"prompt": [104] * 40_000, "max_tokens": "1"}, 400, "max_tokens"),
    ({"prompt": [104] * 40_000, "max_tokens": 1, "temperature": float("nan")}, 400, "temperature: NaN"),
    ({"prompt": "a" * PARSE_OFF_LOOP_BYTES + "\ud800", "max_tokens": 1}, 400, "lone surrogate"),
    ({"prompt": [104] * 40_000, "max_tokens": 1}, 400, "maximum context length"),
])
async def test_a_large_body_is_answered_as_a_small_one(body, status, words):
    """Parsed (by orjson, falling back to Python's parser) and validated off the loop, a large body
    gets the same answers, field names included."""
    content = json.dumps(body).encode("utf-8", "surrogatepass")
    assert len(content) > PARSE_OFF_LOOP_BYTES
    async with asgi_client(create_app(FakeEngine(max_model_len=512), max_body_bytes=1 << 20)) as client:
        answer = await client.post("/v1/completions", content=content, headers=JSON)
    assert answer.status_code == status, answer.text[:300]
    if words is not None:
        assert words in answer.json()["error"]["message"], answer.text[:300]


async def test_two_authorization_headers_are_refused_whichever_holds_the_key():
    async with asgi_client(create_app(FakeEngine(), api_key="k3y")) as client:
        for headers in ([("Authorization", "Bearer wrong"), ("Authorization", "Bearer k3y")],
                        [("Authorization", "Bearer k3y"), ("Authorization", "Bearer k3y")]):
            answer = await client.send(client.build_request("POST", "/v1/completions", json=BODY, headers=headers))
            assert answer.status_code == 400 and "more than one Authorization" in answer.json()["error"]["message"]
        one = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k3y"})
        assert one.status_code == 200


async def test_two_host_headers_are_refused():
    app = create_app(FakeEngine(), allowed_hosts=("localhost",))
    async with asgi_client(app) as client:
        request = client.build_request("GET", "/health", headers=[("Host", "localhost"), ("Host", "evil.com")])
        assert (await client.send(request)).status_code == 400


@pytest.mark.parametrize("name", ["../../etc", "/etc/passwd", ".hidden", "a/../b", "a\\b", "a\x00b", "a\nb",
                                  "a\u202eb", " padded", "tab\t"])
def test_adapter_names_that_read_as_paths_or_hold_control_characters_are_refused(name):
    with pytest.raises(ValueError):
        LoadLoRAAdapterRequest(lora_name=name, lora_path="/x")


@pytest.mark.parametrize("name", ["sql-lora", "org/adapter", "ft:tiny:chat:1a2b3c4d", "a.b_c+1", "日本語"])
def test_ordinary_adapter_names_are_taken(name):
    assert LoadLoRAAdapterRequest(lora_name=name, lora_path="/x").lora_name == name


async def test_adapter_names_are_refused_over_http_with_the_field_named():
    async with asgi_client(create_app(FakeEngine())) as client:
        answer = await client.post("/v1/load_lora_adapter", json={"lora_name": "../../etc", "lora_path": "/tmp"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_name", answer.text


class _Free(StrictBody):
    x: object = None
    prompt: list[int] | None = None


def test_the_walks_over_a_body_are_iterative_whatever_the_nesting():
    """The nesting check bounds a body before parsing; the walks after it hold anyway (no RecursionError)."""
    deep: object = 1.0
    for _ in range(5000):
        deep = [deep]
    inner = _Free.model_validate({"x": deep}).x
    for _ in range(5000):
        inner = inner[0]
    assert inner == 1 and isinstance(inner, int)
    with pytest.raises(ValueError, match="lone surrogate"):
        _Free.model_validate({"x": [[["ok", "\ud800"]]] * 3})
    with pytest.raises(ValueError, match="x.0.0.k: NaN is not a JSON number"):
        _Free.model_validate({"x": [[{"k": float("nan")}]]})


def test_token_id_lists_are_not_rebuilt():
    ids = list(range(100_000))
    assert _Free.model_validate({"prompt": ids}).prompt == ids


async def test_a_large_body_of_floats_converts_them():
    content = json.dumps({"prompt": [104.0] * 40_000, "max_tokens": 1.0}).encode()
    async with asgi_client(create_app(FakeEngine(max_model_len=512), max_body_bytes=1 << 20)) as client:
        answer = await client.post("/v1/completions", content=content, headers=JSON)
    assert answer.status_code == 400 and "maximum context length" in answer.json()["error"]["message"]


def test_httpx_sends_what_the_tests_say():
    """The duplicate-header tests rely on httpx keeping both headers."""
    request = httpx.Request("GET", "http://x/", headers=[("Authorization", "a"), ("Authorization", "b")])
    assert request.headers.get_list("authorization") == ["a", "b"]
