"""Schemathesis: our OpenAPI document tells the truth about every operation (fake engine).

Both generation modes over every operation, with schemathesis' own checks: no 5xx, responses
match their documented status codes, content types and schemas, requests the schema forbids are
refused. Requests the schema allows are accepted, except for the runtime limits the operation's
description names (JSON Schema cannot state the model's context length or vocabulary); those get
a 400 with the code or param the description gives. On top of the hypothesis bodies in
test_fuzz.py, which stress what the schema does not say. Served by uvicorn, so the app runs
with its lifespan (the engine thread) as in production.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from orca_jax.server.app import create_app

from tests.helpers.server import FakeEngine, asgi_client, live_server

APP = create_app(FakeEngine(max_model_len=160), served_model_name="fake", max_body_bytes=256 * 1024)
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.config.seed = 20250127
schema.config.generation.update(modes=["positive", "negative"], max_examples=30)
# The 400s a schema-valid body may get, as app._RUNTIME_RULES documents them: (code, param).
RUNTIME_REFUSALS = {("context_length_exceeded", None), ("token_id_out_of_range", None),
                    ("too_many_choices", None), (None, "best_of"), ("invalid_structured_output", None),
                    (None, "min_tokens"), (None, "logit_bias"), (None, "prompt_logprobs"),
                    ("too_many_stop_strings", None)}
CHAT_RUNTIME_REFUSALS = RUNTIME_REFUSALS | {("auto_tool_choice_disabled", None), (None, "top_logprobs")}
RUNTIME_REFUSALS |= {(None, "logprobs"), (None, "echo")}
LORA_RUNTIME_REFUSALS = {(code, None) for code in ("lora_not_enabled", "lora_already_loaded", "invalid_lora_adapter",
                                                   "lora_not_found")} | {(None, "lora_name")}


@pytest.fixture(scope="module")
def url():
    with live_server(APP) as server:
        yield server.url
    assert not APP.state.async_engine.engine.has_unfinished()


def schema_valid_requests_are_accepted(ctx, response, case):
    """positive_data_acceptance, but a documented runtime refusal is not a finding, nor a body over
    the server's size limit (413, refused before it is read; the schema cannot state a size)."""
    if response.status_code == 413:
        return None
    if response.status_code == 400 and case.meta is not None and case.meta.generation.mode.is_positive:
        error = response.json()["error"]
        refusals = CHAT_RUNTIME_REFUSALS if case.path.endswith("/chat/completions") else \
            LORA_RUNTIME_REFUSALS if case.path.endswith("_lora_adapter") else RUNTIME_REFUSALS
        if (error["code"], None) in refusals or (None, error["param"]) in refusals:
            return None
    return positive_data_acceptance(ctx, response, case)


def test_every_runtime_refusal_is_documented():
    for path, refusals in (("/v1/completions", RUNTIME_REFUSALS), ("/v1/chat/completions", CHAT_RUNTIME_REFUSALS),
                           ("/v1/load_lora_adapter", LORA_RUNTIME_REFUSALS - {("lora_not_found", None)}),
                           ("/v1/unload_lora_adapter", {("lora_not_enabled", None), ("lora_not_found", None)})):
        description = APP.openapi()["paths"][path]["post"]["description"]
        for code, param in refusals:
            assert (f"code {code}" if code else f"param {param}") in description


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_schema_tells_the_truth(case, url):
    case.call_and_validate(base_url=url, excluded_checks=[positive_data_acceptance],
                           additional_checks=[schema_valid_requests_are_accepted])


@pytest.mark.anyio
async def test_the_three_reported_disagreements_agree_now():
    document = APP.openapi()
    components = document["components"]["schemas"]
    for name in ("TextFormat", "JsonObjectFormat", "JsonSchemaFormat"):  # so {} is documented as refused
        assert "type" in components[name]["required"]
    assert components["CompletionRequest"]["properties"]["best_of"]["anyOf"][0]["minimum"] == 1
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    app = create_app(FakeEngine(), served_model_name="fake")
    async with asgi_client(app) as client:
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        empty_format = await client.post("/v1/chat/completions", json={**chat, "response_format": {}})
        text_format = await client.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}})
        best_of_0 = await client.post("/v1/completions", json={"prompt": "x", "best_of": 0})
        float_n = await client.post("/v1/completions", json={"prompt": "x", "n": 2.0, "max_tokens": 1})
        metrics = await client.get("/metrics")
    assert (empty_format.status_code, text_format.status_code, best_of_0.status_code) == (400, 200, 400)
    assert empty_format.json()["error"]["message"] == (
        "response_format: type must be 'text', 'json_object' or 'json_schema'")
    assert float_n.status_code == 200 and len(float_n.json()["choices"]) == 2  # JSON's 2.0 is 2
    assert metrics.headers["content-type"].startswith("text/plain")
