"""Property: whatever a client sends, the server answers below 500, errors in OpenAI's shape.

Bodies mix each field's plausible values with arbitrary JSON, so both the happy path (generation,
streaming) and every validation branch are exercised.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_jax.server.app import create_app

from tests.helpers.fuzz import any_request, check_answer, driven, post_json
from tests.helpers.server import FakeEngine

FUZZ_SETTINGS = settings(max_examples=250, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_fuzzed_completions_and_chats_never_5xx():
    app = create_app(FakeEngine(max_model_len=160), served_model_name="fake", max_body_bytes=4096)
    with driven(app) as call:
        @FUZZ_SETTINGS
        @given(any_request())
        def check(path_and_body):
            check_answer(post_json(call, path_and_body))

        check()
        assert call("GET", "/health").status_code == 200
    assert not app.state.async_engine.engine.has_unfinished()


def test_fuzzed_raw_bytes_and_headers_never_5xx():
    app = create_app(FakeEngine(), max_body_bytes=4096, api_key="key")
    with driven(app) as call:
        @settings(max_examples=150, deadline=None, derandomize=True)
        @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/x"]),
               method=st.sampled_from(["GET", "POST", "PUT"]), content=st.binary(max_size=300),
               content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
               authorization=st.sampled_from(["Bearer key", "Bearer nope", "", "bearer key"]))
        def check(path, method, content, content_type, authorization):
            headers = {"content-type": content_type, "authorization": authorization}
            response = call(method, path, content=content, headers=headers)
            assert response.status_code < 500, (response.status_code, response.text)
            if response.status_code >= 400 and path != "/health":
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
