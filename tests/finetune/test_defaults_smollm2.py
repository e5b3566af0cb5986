"""A new user's fine-tuning run: `python -m orca_jax.serve --model smollm2-135m --enable-fine-tuning` with
every other flag at its default, and a job created through the official client with only n_epochs set,
succeeds (its micro-batch sized to the memory the KV pool lends: 2048 tokens of SmolLM2 need ~4.9 GiB
on a CPU, past the 4 GiB lent by default)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.process import ROOT, checkout_env, free_port, wait_healthy

CHATS = [("Say hi", "hi"), ("Name a color", "blue"), ("Two plus two", "four"), ("Capital of France", "Paris")]
DATASET = "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                  + "\n" for q, a in CHATS).encode()


@pytest.mark.slow  # minutes on a CPU: SmolLM2's serving programs, then three sizes of the job's
def test_a_job_with_only_n_epochs_succeeds_on_the_default_server(tmp_path):
    openai = pytest.importorskip("openai")
    port = free_port()
    command = [sys.executable, "-m", "orca_jax.serve", "--model", "smollm2-135m", "--enable-fine-tuning",
               "--port", str(port)]
    # Its output to a file: a pipe nobody reads while the test waits would fill and stop the server.
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(command, cwd=ROOT, env=checkout_env(ORCA_JAX_FINE_TUNING_DIR=str(tmp_path / "ft")),
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, process, timeout=1800)
        except AssertionError:
            log.seek(0)
            raise AssertionError("the server did not start:\n" + log.read()[-5000:]) from None
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        uploaded = client.files.create(file=("chats.jsonl", io.BytesIO(DATASET)), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="smollm2-135m", training_file=uploaded.id,
                                             hyperparameters={"n_epochs": 1})
        deadline = time.monotonic() + 1800
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(1)
        events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
        assert job.status == "succeeded", (job.error, events)
        assert any(m.startswith("Compiled") and "micro-batches of" in m for m in events), events
        reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=4,
                                               messages=[{"role": "user", "content": "Say hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert process.returncode == 0, output[-5000:]
