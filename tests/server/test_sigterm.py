"""`python -m orca_jax.serve` as a process: SIGTERM mid-stream ends the stream, answers unfinished
uploads 503 (never 500), and exits 0 within its grace period."""

import json
import signal
import socket
import sys
import time

import httpx
import pytest

from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port, wait_healthy




def _stalled_upload(port: int) -> socket.socket:
    """A request whose body stops halfway (its Content-Length is never reached)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"a")
    return sock


def _answer(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("engine_flag", ["--no-engine-process", "--engine-process", "--api-server-count=2"])
def test_sigterm_mid_stream_ends_the_stream_and_exits_zero(engine_flag):
    port = free_port()
    # page size 128 keeps every sequence in one page-table bucket: no compile mid-stream.
    command = [sys.executable, "-m", "orca_jax.serve", "--model", "tiny-llama", "--port", str(port),
               "--page-size", "128", "--num-kv-pages", "8", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "8", "--log-level", "warning", engine_flag]
    env = checkout_env()
    process = OutputDrained(command, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=180)
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        uploads = [_stalled_upload(port) for _ in range(3)]
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:  # generation is under way
                    process.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
        answers = [_answer(sock) for sock in uploads]
        output, _ = process.communicate(timeout=60)
        exit_seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    # Unfinished uploads are answered at once, and do not hold the exit back to uvicorn's timeout.
    assert all(answer.startswith(b"HTTP/1.1 503 ") and b"shutting_down" in answer for answer in answers)
    assert exit_seconds < 5, output
    assert "500" not in output and "Exception in ASGI application" not in output, output
    assert events[-1] == "[DONE]"
    finish_reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish_reasons[-1] in ("abort", "length") and set(finish_reasons[:-1]) == {None}
    assert finish_reasons[-1] == "abort" or len(events) == 501
