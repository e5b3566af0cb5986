"""prompt_logprobs and echo with logprobs over HTTP (vLLM's shapes), on tiny-llama with the numbers
checked against numpy on the serving forward's logits; refusals on a server without the flag."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from orca_jax.config import SamplingConfig
from orca_jax.server.app import create_app
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.engines import tiny_engine
from tests.helpers.models import prompt_logits
from tests.helpers.server import FakeEngine, asgi_client, parse_sse

PROMPT = [(5 * i + 7) % 120 + 32 for i in range(21)]  # printable bytes: the byte tokenizer's text
BOUND = 1e-5  # fp32 on CPU: the prompt forward and the paged forward differ by reassociation only
ENGINE = dict(max_model_len=128, sampling=SamplingConfig(max_logprobs=5, enable_prompt_logprobs=True))


@pytest.fixture(scope="module")
def served():
    """(engine, f64[n - 1, V] reference log_softmax at each prompt position); the reference is computed
    before any app drives the engine (each test serves it with an app of its own)."""
    engine = tiny_engine(**ENGINE)
    logits = prompt_logits(engine.runner, PROMPT).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return engine, reference


def check_positions(positions: list, reference: np.ndarray, k: int, decode) -> None:
    assert len(positions) == len(PROMPT) and positions[0] is None
    for i in range(1, len(PROMPT)):
        row, token = reference[i - 1], PROMPT[i]
        entries = positions[i]
        assert list(entries)[0] == str(token)  # the prompt token first
        assert abs(entries[str(token)]["logprob"] - row[token]) < BOUND
        assert entries[str(token)]["rank"] == int(np.sum(row > row[token])) + 1
        top = np.argsort(-row, kind="stable")[:k]
        assert {t: e["rank"] for t, e in entries.items() if e["rank"] <= k} == \
            {str(t): rank for rank, t in enumerate(top, 1)}
        assert set(entries) <= {str(token)} | {str(t) for t in top}
        assert all(e["decoded_token"] == decode([int(t)]) for t, e in entries.items())


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["thread", "process"])
async def test_completions_and_chat_return_vllm_prompt_logprobs(served, mode):
    engine, reference = served
    # In process mode an engine core built alike (same seed: same weights) computes them in a child.
    driven = engine if mode == "thread" else ProcessEngine(functools.partial(tiny_engine, **ENGINE))
    async with asgi_client(create_app(driven, served_model_name="tiny")) as client:
        completion = (await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})).json()
        plain = (await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).json()
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0, "n": 2})
    choice = completion["choices"][0]
    check_positions(choice["prompt_logprobs"], reference, 2, engine.tokenizer.decode)
    assert choice["logprobs"] is None and "prompt_logprobs" not in plain["choices"][0]
    assert chat.status_code == 200, chat.text
    body = chat.json()
    positions = body["prompt_logprobs"]  # vLLM puts a chat's on the response, not on each choice
    assert len(positions) == body["usage"]["prompt_tokens"] and positions[0] is None
    assert all(len(p) == 1 and next(iter(p.values()))["logprob"] <= 0 for p in positions[1:])
    assert all("prompt_logprobs" not in c for c in body["choices"])


@pytest.mark.anyio
async def test_echo_with_logprobs_puts_the_prompts_logprobs_first(served):
    engine, reference = served
    request = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}
    async with asgi_client(create_app(engine, served_model_name="tiny")) as client:
        whole = (await client.post("/v1/completions", json=request)).json()["choices"][0]
        streamed = parse_sse((await client.post("/v1/completions", json={**request, "stream": True})).text)
    decode = engine.tokenizer.decode
    logprobs = whole["logprobs"]
    n = len(PROMPT)
    assert whole["text"].startswith(decode(PROMPT)) and "prompt_logprobs" not in whole
    assert len(logprobs["tokens"]) == n + 3
    assert logprobs["tokens"][:n] == [decode([t]) for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # OpenAI's legacy shape
    for i in range(1, n):
        row = reference[i - 1]
        assert abs(logprobs["token_logprobs"][i] - row[PROMPT[i]]) < BOUND
        assert set(logprobs["top_logprobs"][i]) == {decode([int(t)]) for t in np.argsort(-row)[:2]}
    assert logprobs["text_offset"] == list(np.cumsum([0] + [len(t) for t in logprobs["tokens"][:-1]]))
    chunks = [event["choices"][0] for event in streamed[:-1] if event["choices"]]
    first = chunks[0]["logprobs"]  # the echo's chunk carries the prompt's logprobs and the first token's
    assert first["tokens"] == logprobs["tokens"][:n + 1]
    assert first["token_logprobs"][0] is None
    np.testing.assert_allclose(first["token_logprobs"][1:], logprobs["token_logprobs"][1:n + 1], atol=BOUND)
    assert [c["logprobs"]["tokens"] for c in chunks[1:]] == [[t] for t in logprobs["tokens"][n + 1:]]
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.mark.anyio
async def test_refusals(served):
    async with asgi_client(create_app(served[0], served_model_name="tiny")) as client:
        streamed = await client.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 1, "stream": True})
        too_many = await client.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 6})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"
    async with asgi_client(create_app(FakeEngine(), served_model_name="fake")) as client:
        off = await client.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 1})
        chat_off = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1})
        echo_off = await client.post("/v1/completions", json={"prompt": "ab", "echo": True, "logprobs": 1})
    for response, param in ((off, "prompt_logprobs"), (chat_off, "prompt_logprobs"), (echo_off, "echo")):
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param
        assert "--enable-prompt-logprobs" in error["message"]
