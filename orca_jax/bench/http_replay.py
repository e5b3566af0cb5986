"""The core benchmark's uniform trace through the HTTP server: what the HTTP layer costs.

Starts `python -m orca_jax.serve` as a child with the engine shape and compilation cache of the
in-process sections, waits until /health says every program is compiled, reads the program count
from /metrics, replays the trace twice with the serve client (all requests at once, streamed, EOS
ignored, as in-process), and reads the count again: serving must compile nothing new.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx

from orca_jax.bench.serve_client import ServeBenchConfig, run
from orca_jax.bench.traces import TraceKind

COMPILED = re.compile(r"^orca_jax:num_compiled_programs\{[^}]*\} ([0-9.e+]+)$", re.M)


def _compiled_programs(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return int(float(COMPILED.search(text).group(1)))


def _wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")


def serve_flags(setup, port: int, cache_dir: str) -> list[str]:
    """`python -m orca_jax.serve`'s flags for the engine shape of the in-process sections."""
    return ["--model", setup.model, "--port", str(port), "--dtype", setup.dtype,
            "--max-num-seqs", str(setup.max_num_seqs), "--max-num-batched-tokens", str(setup.max_num_batched_tokens),
            "--max-waiting", str(max(4096, setup.num_requests)),
            "--kv-allocation", "reserve",  # the in-process sections' (the library default)
            "--compilation-cache-dir", cache_dir, "--log-level", "warning"]


def http_replay(setup, cache_dir: str, log_path: str, vocab_size: int, *, port: int = 8765,
                ready_timeout_s: float = 600.0) -> dict:
    """Two replays of setup's uniform trace through a served engine; its start-up, program counts and
    the client's summaries (output tokens/s, TTFT, TPOT)."""
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "orca_jax.serve", *serve_flags(setup, port, cache_dir)]
    with open(log_path, "w") as log:
        started = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            ready_s = _wait_ready(base_url, server, ready_timeout_s)
            result: dict = {"command": " ".join(cmd), "process_to_ready_s": time.perf_counter() - started,
                            "wait_ready_s": ready_s, "programs_at_ready": _compiled_programs(base_url)}
            config = ServeBenchConfig(base_url=base_url, model=setup.model, num_requests=setup.num_requests,
                                      trace=TraceKind.UNIFORM, lengths=setup.lengths, vocab_size=vocab_size,
                                      timeout_s=ready_timeout_s)
            result["runs"] = [asyncio.run(run(config, progress=False))[0] for _ in range(2)]
            result["programs_after"] = _compiled_programs(base_url)
            return result
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
