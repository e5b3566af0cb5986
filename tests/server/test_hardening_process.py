"""`python -m orca_jax.serve` as a process when its start or its engine fails: a port in use ends
the start at once; an engine loop that raises answers every request in flight and exits non-zero."""

import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy


def test_a_port_in_use_ends_the_start_before_loading_anything():
    """(1.2-1.5 s on an idle 2-core machine, Python's start included: what ends it early is told by the
    log, which a busy host cannot change, not by the clock, which it can.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "orca_jax.serve", "--port", str(port), *TINY_SERVER],
                              cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "in use" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "loading" not in done.stderr


def test_a_failed_engine_loop_answers_every_request_and_exits_non_zero():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = OutputDrained([sys.executable, "tests/helpers/serve_with_failing_engine.py",
                             "--port", str(port), *TINY_SERVER], cwd=ROOT, env=checkout_env())
    try:
        wait_healthy(url, process, timeout=600)  # bounds a hang; a busy host starts slowly
        body = {"prompt": "hi", "max_tokens": 20, "temperature": 0}
        streamed = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                streamed.extend(line for line in r.iter_lines() if line)

        streaming = threading.Thread(target=stream)
        streaming.start()
        answer = httpx.post(url + "/v1/completions", json=body, timeout=30)
        failed_at = time.monotonic()
        streaming.join(30)
        output, _ = process.communicate(timeout=30)
        exit_seconds = time.monotonic() - failed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert answer.status_code == 503 and "engine loop failed" in answer.json()["error"]["message"], answer.text
    # The stream got the error as an event, or as a 503 if it came after the failure.
    assert "engine loop failed" in "".join(streamed) and "engine_unavailable" in "".join(streamed), streamed
    assert streamed[-1] == "data: [DONE]" or len(streamed) == 1, streamed
    assert process.returncode == 1, output
    assert exit_seconds < 25, output  # not uvicorn's 30 s graceful shutdown: it exits once answered
    assert "the engine loop failed" in output, output
