"""Every request gets an answer: one the engine ends itself (here a grammar with no way on) comes
back with finish_reason "error" and the reason, from the engine, and over HTTP streamed and not."""

from __future__ import annotations

import pytest

from orca_jax import SamplingParams
from orca_jax.server.app import create_app
from orca_jax.structured import Constraint, ConstraintKind

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.server import asgi_client, parse_sse

# Every output must start with "a", and no output can ever end: llguidance refuses the first "a".
NO_WAY_ON = 'start: "a" start'


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64)


def test_the_engine_answers_a_request_it_ends_with_its_error(engine):
    grammar = Constraint(ConstraintKind.GRAMMAR, NO_WAY_ON)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=grammar), request_id="dead")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), request_id="free")
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    dead = finals["dead"]
    assert dead.finish_reason == "error" and dead.error.caused_by_request
    assert "is not allowed by the request's grammar" in dead.error.message
    assert finals["free"].finish_reason == "length" and finals["free"].error is None
    assert engine.stats().kv_pages_used == 0


def test_a_client_abort_is_still_not_answered(engine):
    engine.add_request([5, 6], SamplingParams(max_tokens=8), request_id="gone")
    engine.step()
    engine.abort("gone")
    assert drain(engine) == {}


@pytest.mark.anyio
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_an_engine_ended_request_is_answered_streamed_and_not(engine, path, body):
    body = {**body, "max_tokens": 8, "structured_outputs": {"grammar": NO_WAY_ON}}
    async with asgi_client(create_app(engine, served_model_name="tiny")) as client:
        answer = await client.post(path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "generation_failed" and "not allowed by the request's grammar" in error["message"]

        streamed = await client.post(path, json={**body, "stream": True})
        assert streamed.status_code == 200
        events = parse_sse(streamed.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "generation_failed"
        assert events[-3]["choices"][0]["finish_reason"] == "error"
