"""`python -m orca_jax.serve` as a process (tiny-llama, fine-tuning on): no TPU probe line in the log,
--max-json-depth end to end, and SIGTERM while an upload is being checked: the upload gets a 503 and
the process exits 0 within its grace period (it needed SIGKILL)."""

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port, wait_healthy


@pytest.mark.slow  # a server start (~60 s on a busy 2-core machine)
def test_serve_start_deep_bodies_and_sigterm_during_an_upload(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "orca_jax.serve", "--model", "tiny-llama", "--port", str(port),
               "--page-size", "128", "--num-kv-pages", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "8",
               "--enable-fine-tuning", "--fine-tuning-dir", str(tmp_path / "ft"), "--max-lora-rank", "8",
               "--max-json-depth", "10", "--compilation-cache-dir", str(tmp_path / "xla")]
    process = OutputDrained(command, cwd=ROOT, env=checkout_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=300)
        deep = '{"prompt": "a", "max_tokens": 1, "x": ' + "[" * 10 + "]" * 10 + "}"
        answer = httpx.post(url + "/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and "more than 10 levels deep" in answer.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200

        # A file whose check takes a while (~20 s): 30,000 chats of 32 messages (476 tokens of the 512).
        turns = []
        for i in range(16):
            turns += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        data = (json.dumps({"messages": turns}) + "\n").encode() * 30_000
        answers = []

        def post_upload():
            answers.append(httpx.post(url + "/v1/files", files={"file": ("d.jsonl", data)},
                                      data={"purpose": "fine-tune"}, timeout=120))

        uploader = threading.Thread(target=post_upload)
        uploader.start()
        time.sleep(3)  # sent, and being checked
        assert not answers, "the check ended too soon to stand for a long one"
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        output, _ = process.communicate(timeout=60)
        exit_seconds = time.monotonic() - signalled
        uploader.join(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert exit_seconds < 15, (exit_seconds, output)  # the grace period is 0 s (+10 s for uvicorn)
    assert answers and answers[0].status_code == 503, answers and answers[0].text
    assert answers[0].json()["error"]["code"] == "shutting_down"
    assert "Unable to initialize backend 'tpu'" not in output
    assert "ready at" in output
