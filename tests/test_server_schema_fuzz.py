"""Schemathesis: requests generated from our own OpenAPI schema never get a 5xx (fake engine).

On top of the hypothesis bodies in test_server_fuzz.py, which stress what the schema does not say,
this walks every operation and every field the schema declares, valid and not. Served by uvicorn,
so the app runs with its lifespan (the engine thread) as in production.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from orca_jax.server import create_app

from server_helpers import FakeEngine, live_server

APP = create_app(FakeEngine(max_model_len=160), served_model_name="fake", max_body_bytes=8192)
schema = schemathesis.openapi.from_dict(APP.openapi())


@pytest.fixture(scope="module")
def url():
    with live_server(APP) as server:
        yield server.url
    assert not APP.state.async_engine.engine.has_unfinished()


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case, url):
    case.call_and_validate(base_url=url, checks=[not_a_server_error])
