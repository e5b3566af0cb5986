"""`python -m orca_jax.serve` under issue 47's attacks, as a process: a 50 MB upload answered within
10 s with the server's memory bounded (it grew 4.4 GB before, answering after 7 minutes), and SIGTERM
while a fine-tuning job compiles exits within the grace period (interpreter exit joined the compile's
thread: 10-100 s late)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy

pytestmark = pytest.mark.slow  # a server start and a 50 MB upload (~40 s on a busy 2-core machine)
LINE = (json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 2,
                    "completion": " and runs away into the forest."}) + "\n").encode()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_50_mb_upload_is_answered_in_10_s_and_sigterm_mid_compile_exits_at_once(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "orca_jax.serve", *TINY_SERVER, "--port", str(port), "--enable-fine-tuning",
               "--fine-tuning-dir", str(tmp_path / "ft"), "--max-lora-rank", "8"]
    process = OutputDrained(command, cwd=ROOT, env=checkout_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=300)
        data = LINE * (50 * 10**6 // len(LINE))
        before = _rss_mib(process.pid)
        start = time.monotonic()
        answer = httpx.post(url + "/v1/files", files={"file": ("d.jsonl", data)}, data={"purpose": "fine-tune"},
                            timeout=120)
        took = time.monotonic() - start
        grown = _rss_mib(process.pid) - before
        assert answer.status_code == 200 and answer.json()["bytes"] == len(data), answer.text
        # On a machine with more runnable threads than cores, seconds stretch with the load (1 on a free one).
        load = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
        assert took < 10 * load, (took, load)
        assert grown < 300, grown  # the multipart parser's buffers, not the file (nor its examples)

        small = httpx.post(url + "/v1/files", files={"file": ("s.jsonl", LINE * 8)}, data={"purpose": "fine-tune"})
        job = httpx.post(url + "/v1/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": small.json()["id"],
                                                            "hyperparameters": {"n_epochs": 100}}, timeout=60)
        assert job.status_code == 200, job.text
        process.send_signal(signal.SIGTERM)  # while the job's programs compile (or its first steps run)
        signalled = time.monotonic()
        output, _ = process.communicate(timeout=120)
        exit_seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert exit_seconds < 5, (exit_seconds, output[-3000:])  # grace period 0 s
