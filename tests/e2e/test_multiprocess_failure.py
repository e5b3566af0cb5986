"""Several controller processes fail together: two `python -m orca_jax.serve` processes on localhost form
one tensor-parallel mesh (one fake CPU device each, as one process per GPU runs); one is killed while a
response streams. The other exits non-zero at once, naming the process that is gone, and the
client's stream ends in an error instead of hanging."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.helpers.mesh import fake_device_env
from tests.helpers.process import ROOT, free_port, wait_healthy


def start_pair(coordinator_port: int, http_port: int, logs) -> list[subprocess.Popen]:
    flags = ["--model", "tiny-llama", "--tensor-parallel-size", "2", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "64", "--coordinator-address", f"127.0.0.1:{coordinator_port}",
             "--num-processes", "2", "--port", str(http_port), "--compilation-cache-dir", "none"]
    env = fake_device_env(1)
    return [subprocess.Popen([sys.executable, "-m", "orca_jax.serve", *flags, "--process-id", str(i)], cwd=ROOT,
                             env=env, stdout=logs[i], stderr=subprocess.STDOUT) for i in (0, 1)]


def _read(log) -> str:
    """A process's log, its last 4,000 characters."""
    log.seek(0)
    return log.read()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_the_other_and_the_stream_fails(tmp_path, victim):
    logs = [open(tmp_path / f"process_{i}.log", "w+") for i in (0, 1)]
    http_port = free_port()
    coordinator_port = free_port()
    while coordinator_port == http_port:  # two asks can get one port: the coordinator would then abort at start
        coordinator_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    processes = start_pair(coordinator_port, http_port, logs)
    try:
        try:
            wait_healthy(url, processes[0], timeout=300)
        except AssertionError:
            raise AssertionError("the pair did not start:\n" + "\n".join(_read(log) for log in logs)) from None
        # Long enough that the kill lands mid-stream on a fast machine too: with 120 tokens the server
        # could finish the whole response before the client had read its first chunks.
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 480, "stream": True, "ignore_eos": True}
        chunks, killed = 0, False
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                for _ in response.iter_lines():
                    chunks += 1
                    if chunks == 1:
                        processes[victim].kill()
                        killed = True
        assert killed
        survivor = processes[1 - victim]
        # Its watchdog ends it (the log names the process gone), not jax's heartbeat (--peer-timeout-s,
        # 60 s); the bound leaves a loaded machine room and still tells the two apart.
        assert survivor.wait(timeout=45) == 1
        assert f"controller process {victim} is gone" in _read(logs[1 - victim])
    finally:
        for process in processes:
            process.kill()
            process.wait()
        for log in logs:
            log.close()
