"""`python -m orca_jax.client` against a live server over the fake engine."""

import io
import json
import signal
import subprocess
import sys

import pytest

from orca_jax import client
from orca_jax.server.app import create_app

from tests.helpers.process import ROOT, checkout_env
from tests.helpers.server import FakeEngine, expected_text, live_server


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


def test_batch_mode_writes_jsonl_and_a_summary(served, tmp_path, capsys):
    engine, server = served
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n" + json.dumps({"prompt": "abc", "max_tokens": 3}) + "\n"
                       + json.dumps({"prompt": "x", "top_p": 7}) + "\n")
    out = tmp_path / "results.jsonl"
    code = client.main(["--url", server.url, "--api-key", "k", "batch", str(prompts), "-o", str(out),
                        "--concurrency", "2"])
    assert code == 1  # one request failed
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2, 3]  # the file's order, whatever finished first
    assert [r["prompt"] for r in results] == ["one", "two", "abc", "x"]  # failed ones too
    assert results[2]["text"] == "def" and "top_p" in results[3]["error"]
    # Every request named its max_tokens: the client's default unless the line set one.
    assert [s.max_tokens for s in engine.samplings] == [client.DEFAULT_MAX_TOKENS] * 2 + [3]
    assert results[0]["completion_tokens"] == client.DEFAULT_MAX_TOKENS
    summary = capsys.readouterr().err
    assert f"4 requests, 1 failed, {2 * client.DEFAULT_MAX_TOKENS + 3} tokens generated" in summary
    assert str(out) in summary


def _ctrl_c_case(case: str) -> dict:
    """tests/helpers/ctrl_c_cases.py CASE in a process of its own, SIGINT's default action restored
    there (a suite started in the background inherits SIGINT ignored); what it saw."""
    done = subprocess.run([sys.executable, "tests/helpers/ctrl_c_cases.py", case], cwd=ROOT, env=checkout_env(),
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_reply_or_interrupt_turns_ctrl_c_into_a_cancelled_reply():
    seen = _ctrl_c_case("reply_or_interrupt")
    assert seen == {"first": None, "cancelled": [True], "second": "done"}  # the session goes on


def test_ctrl_c_in_chat_stops_the_reply_and_keeps_the_conversation():
    seen = _ctrl_c_case("chat")
    out = seen["out"]
    assert "[stopped]" in out and out.count("assistant> ") == 2
    assert seen["aborted"] == 1  # the server saw the stream close and let the request go
    first, second = seen["prompts"]
    partial = out.split("assistant> ")[1].split("\n")[0]
    assert "hello" in second and partial in second and "go on" in second


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_batch_mode_shows_a_progress_bar_on_a_terminal(served, tmp_path, monkeypatch):
    _, server = served
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert client.main(["--url", server.url, "--api-key", "k", "batch", str(prompts), "--max-tokens", "2"]) == 0
    shown = terminal.getvalue()
    assert "3/3" in shown and "req" in shown and "tokens=6" in shown
    assert shown.splitlines()[-1].startswith("3 requests, 0 failed, 6 tokens generated in ")


def test_help_shows_the_url_it_calls_and_the_other_defaults(capsys):
    with pytest.raises(SystemExit):
        client.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: http://127.0.0.1:8000)" in text and "(default: 600.0)" in text
    with pytest.raises(SystemExit):
        client.main(["batch", "--help"])
    assert "(default: 256)" in " ".join(capsys.readouterr().out.split())  # --max-tokens
