"""What serve's API flags do to the app, on a live server over the fake engine: CORS, a root path
behind a proxy (the key still required), a chat template of one's own, one log line per request."""

import logging

import httpx
import pytest

from orca_jax.server.app import CORSPolicy, create_app

from tests.helpers.server import FakeEngine, chatml_tokenizer, live_server

KEY = "sk-test"


def test_cors_answers_preflights_for_allowed_origins_only():
    app = create_app(FakeEngine(), served_model_name="fake", api_key=KEY,
                     cors=CORSPolicy(("https://app.example",), ("POST",), ("authorization", "content-type")))
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with live_server(app) as server:
        allowed = httpx.options(server.url + "/v1/completions",
                                headers={"Origin": "https://app.example", **preflight})
        refused = httpx.options(server.url + "/v1/completions",
                                headers={"Origin": "https://evil.example", **preflight})
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                            headers={"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"})
        keyless = httpx.post(server.url + "/v1/completions", json={"prompt": "abc"},
                             headers={"Origin": "https://app.example"})
    # The preflight needs no key; the real request does, and both carry the CORS headers.
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == "https://app.example"


def test_without_cors_no_page_elsewhere_may_read_the_answers():
    with live_server(create_app(FakeEngine(), served_model_name="fake")) as server:
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 1},
                              headers={"Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_behind_a_root_path_routes_answer_and_the_key_is_still_required():
    app = create_app(FakeEngine(), served_model_name="fake", api_key=KEY)
    with live_server(app, root_path="/llm") as server:
        # The proxy strips /llm; uvicorn puts it back into the path, and the app routes without it.
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        keyless = httpx.get(server.url + "/v1/models")
        schema = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"
    assert keyless.status_code == 401
    assert schema.json()["servers"] == [{"url": "/llm"}]


def test_a_chat_template_of_ones_own_replaces_the_models():
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    engine = FakeEngine(tokenizer=chatml_tokenizer())
    app = create_app(engine, served_model_name="fake", chat_template=template)
    with live_server(app) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert response.status_code == 200
    assert engine.tokenizer.decode(engine.prompts[-1]) == "[user] hi\n[assistant] "
    assert "<|im_start|>" in engine.tokenizer.chat_template  # the engine's own tokenizer is untouched


@pytest.mark.parametrize("log_requests", [True, False])
def test_one_log_line_per_request_unless_disabled(caplog, log_requests):
    app = create_app(FakeEngine(), served_model_name="fake", log_requests=log_requests)
    with caplog.at_level(logging.INFO, logger="orca_jax.requests"), live_server(app) as server:
        for body in ({"prompt": ["xyz", "qr"], "max_tokens": 3, "n": 2, "seed": 7},
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            assert httpx.post(server.url + path, json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "orca_jax.requests"]
    if not log_requests:
        assert lines == []
        return
    assert len(lines) == 2
    assert lines[0].startswith("cmpl-") and "2 prompt(s) of 2/3 tokens, n=2, max_tokens=3" in lines[0]
    # The prompt's text stays out of the log ("xyz" has no hex digit: no request id can hold it).
    assert "seed=7" in lines[0] and "stream=False" in lines[0] and "xyz" not in lines[0]
    assert lines[1].startswith("chatcmpl-") and "max_tokens=2" in lines[1] and "stream=True" in lines[1]
