"""`python -m orca_jax.client` against a live server over the fake engine."""

import json

import pytest

from orca_jax import client
from orca_jax.server import create_app

from server_helpers import FakeEngine, expected_text, live_server


@pytest.fixture
def served():
    engine = FakeEngine(max_model_len=512, num_pages=1024)
    with live_server(create_app(engine, api_key="k")) as server:
        yield engine, server


def test_batch_mode_sends_everything_with_low_priority(served, tmp_path, capsys):
    engine, server = served
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\n" + json.dumps({"prompt": "abc", "max_tokens": 3}) + "\nsecond\n")
    code = client.main(["--url", server.url, "--api-key", "k", "batch", str(prompts), "--jsonl",
                        "--max-tokens", "4"])
    assert code == 0
    results = {r["index"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(results) == [0, 1, 2]
    assert results[1]["text"] == expected_text("abc", 3) and results[1]["completion_tokens"] == 3
    assert all(r["finish_reason"] == "length" and r["seconds_to_first_token"] <= r["seconds"]
               for r in results.values())
    assert engine.priorities == [client.BATCH_PRIORITY] * 3


def test_batch_mode_reports_failures(served, tmp_path, capsys):
    _, server = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "temperature": -1}) + "\n")
    assert client.main(["--url", server.url, "--api-key", "k", "batch", str(prompts)]) == 1
    assert "temperature" in capsys.readouterr().out
    assert client.main(["--url", server.url, "batch", str(tmp_path / "missing.txt")]) == 2


def test_chat_mode_streams_and_keeps_history(served, monkeypatch, capsys):
    engine, server = served
    lines = iter(["hello", "again", "/reset", "fresh", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert client.main(["--url", server.url, "--api-key", "k", "chat", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 3 and "finish: length" in out
    assert engine.priorities == [client.CHAT_PRIORITY] * 3
    first, second, after_reset = (bytes(p).decode() for p in engine.prompts)
    assert "hello" in second and expected_text(first, 3) in second and "again" in second
    assert "hello" not in after_reset and "fresh" in after_reset
