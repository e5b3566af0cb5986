"""Requests a client might send, for property tests of the server (hypothesis strategies), and an app
driven on one event loop so each example is a plain call."""

import asyncio
import contextlib
import json

import httpx
from hypothesis import strategies as st

# Lone surrogates ("\\ud800") are valid in a JSON text but not in UTF-8: the server must say 400.
SURROGATE_TEXT = st.text(st.characters(categories=("Cs", "Ll")), min_size=1, max_size=4)
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=12) | SURROGATE_TEXT)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, plausible, JSON_VALUES)  # plausible values twice as often


SHARED_FIELDS = {
    "model": _field(st.sampled_from(["fake", "tiny-llama", "other"])),
    "max_tokens": _field(st.integers(-2, 40) | st.integers(0, 2**64)),
    "temperature": _field(st.floats(-1, 3)),
    "top_p": _field(st.floats(-0.5, 1.5)),
    "top_k": _field(st.integers(-3, 300) | st.integers(-2**40, 2**40)),
    "seed": _field(st.integers(-5, 2**64)),
    "stop": _field(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": _field(st.integers(0, 3)),
    "ignore_eos": _field(st.booleans()),
    "priority": _field(st.integers(-20, 20) | st.integers(-2**40, 2**40)),
    "deadline": _field(st.floats(-1, 100)),
    "user": _field(st.text(max_size=5)),
    "presence_penalty": _field(st.floats(-1, 1)),
    "logit_bias": _field(st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2)),
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "prompt": _field(st.text(max_size=40) | st.lists(st.integers(-2, 300), max_size=12)
                     | st.lists(st.text(max_size=5), max_size=2)),
    "logprobs": _field(st.integers(-1, 25)),
    "echo": _field(st.booleans()),
}
MESSAGE = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["system", "user", "assistant", "developer", "tool"]))},
    optional={"content": _field(st.text(max_size=20) | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
        max_size=2)), "name": st.text(max_size=4)})
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "messages": _field(st.lists(MESSAGE, max_size=3)),
    "max_completion_tokens": _field(st.integers(-2, 40)),
    "logprobs": _field(st.booleans()),
    "top_logprobs": _field(st.integers(-1, 25)),
}


# Values the server should accept, so that generation, streaming and stopping get fuzzed too.
VALID_SHARED = {
    "model": st.just("fake"), "max_tokens": st.integers(1, 40), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 300), "seed": st.integers(0, 2**32 - 1),
    "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "priority": st.integers(-5, 5), "n": st.just(1),
}
VALID_COMPLETION = {**VALID_SHARED, "logprobs": st.integers(0, 20),
                    "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 255), min_size=1, max_size=12)}
VALID_CHAT = {**VALID_SHARED, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 30),
              "messages": st.lists(st.fixed_dictionaries({
                  "role": st.sampled_from(["system", "user", "assistant"]),
                  "content": st.text(max_size=20)}), min_size=1, max_size=3)}


def bodies(fields: dict, required: str) -> st.SearchStrategy:
    present = {required: fields[required]}
    optional = {k: v for k, v in fields.items() if k != required}
    return st.fixed_dictionaries(present, optional=optional) | st.fixed_dictionaries({}, optional=fields)


@contextlib.contextmanager
def driven(app):
    """Run `app` (lifespan included) on one event loop that each call below re-enters."""
    with asyncio.Runner() as runner:
        stack = contextlib.AsyncExitStack()
        client = runner.run(_open(stack, app))
        try:
            yield lambda method, path, **kwargs: runner.run(client.request(method, path, **kwargs))
        finally:
            runner.run(stack.aclose())


async def _open(stack: contextlib.AsyncExitStack, app) -> httpx.AsyncClient:
    await stack.enter_async_context(app.router.lifespan_context(app))
    return await stack.enter_async_context(
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz"))


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
    else:
        assert response.json()["choices"]


def any_request() -> st.SearchStrategy:
    """(path, body) pairs: arbitrary and mostly-valid bodies for both generation endpoints."""
    return st.one_of(bodies(COMPLETION_FIELDS, "prompt").map(lambda b: ("/v1/completions", b)),
                     bodies(CHAT_FIELDS, "messages").map(lambda b: ("/v1/chat/completions", b)),
                     bodies(VALID_COMPLETION, "prompt").map(lambda b: ("/v1/completions", b)),
                     bodies(VALID_CHAT, "messages").map(lambda b: ("/v1/chat/completions", b)))


def post_json(call, path_and_body) -> httpx.Response:
    path, body = path_and_body
    return call("POST", path, content=json.dumps(body), headers={"content-type": "application/json"})
