"""What the HTTP server costs per streamed token, on CPU, with no model (SyntheticEngine).

The same uniform trace runs twice: in-process (engine.step() until done) and through the served app
(uvicorn configured as `python -m orca_jax.serve` configures it, in a thread of this process) with
`python -m orca_jax.bench serve` as the client in a child process, so the client's own parsing does
not take this process's GIL. Each thread's CPU clock says where the server's time went: the event
loop's CPU per token is what the engine thread has to share the GIL with.

With host_ms/device_ms > 0 each engine step holds the GIL for host_ms of CPU and then sleeps
device_ms, a stand-in for the real engine's critical path; the served/in-process ratio then shows
how much event-loop work slows the engine down, as on the GPU.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time

from orca_jax.bench.synthetic_engine import SyntheticEngine
from orca_jax.bench.traces import TraceKind, make_trace
from orca_jax.request import SamplingParams
from orca_jax.server import gc_and_gil
from orca_jax.server.app import create_app
from orca_jax.server.in_thread import served_in_thread


def _thread_cpu_seconds(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def in_process_tokens_per_s(engine: SyntheticEngine, num_requests: int, seed: int,
                            max_tokens: int | None = None) -> float:
    """The trace through engine.step() alone: the number the served one is compared with."""
    trace = make_trace(TraceKind.UNIFORM, num_requests, None, seed)
    start = time.perf_counter()
    for index, spec in enumerate(trace.requests):
        engine.add_request(trace.prompt_ids(index, engine.model_config.vocab_size),
                           SamplingParams(max_tokens=max_tokens or spec.max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine.stats().generated_tokens_total / (time.perf_counter() - start)


def _run_client(base_url: str, num_requests: int, seed: int, vocab_size: int,
                max_tokens: int | None) -> tuple[dict, float]:
    """The serve client in a child process: its summary and the CPU seconds it used."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "client.json")
        cmd = [sys.executable, "-m", "orca_jax.bench", "serve", "--base-url", base_url, "--model", "synthetic",
               "--num-prompts", str(num_requests), "--seed", str(seed), "--vocab-size", str(vocab_size),
               "--no-progress", "--out", out] + (["--max-tokens", str(max_tokens)] if max_tokens else [])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(out, encoding="utf-8") as f:
            summary = json.load(f)["summary"]
    return summary, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def served_run(engine: SyntheticEngine, num_requests: int, seed: int, *, max_tokens: int | None = None,
               profile_path: str | None = None) -> dict:
    """The trace through the served app; tokens/s and CPU microseconds per token of each thread."""
    profiler = cProfile.Profile() if profile_path else None
    app = create_app(engine)
    # serve.py's settings (uvicorn's defaults) plus a backlog for every request arriving at once.
    with served_in_thread(app, backlog=4096, wrap_run=None if profiler is None else profiler.runcall) as served:
        base_url, loop_thread = served.url, served.thread
        loop_cpu = _thread_cpu_seconds(loop_thread.ident)
        tokens = engine.stats().generated_tokens_total
        summary, client_cpu = _run_client(base_url, num_requests, seed, engine.model_config.vocab_size,
                                          max_tokens)
        loop_cpu = _thread_cpu_seconds(loop_thread.ident) - loop_cpu
        engine_cpu = _thread_cpu_seconds(engine.step_thread_ident)  # that thread started with this run
        tokens = engine.stats().generated_tokens_total - tokens
    if profiler is not None:
        profiler.dump_stats(profile_path)
    per_token_us = 1e6 / max(tokens, 1)
    return {
        "tokens": tokens,
        "failed": summary["failed"],
        "served_tokens_per_s": summary["output_throughput"],
        "loop_cpu_us_per_token": loop_cpu * per_token_us,
        "engine_thread_cpu_us_per_token": engine_cpu * per_token_us,
        "client_cpu_us_per_token": client_cpu * per_token_us,
        "mean_tpot_ms": summary["tpot_ms"].get("mean"),
        "min_ttft_ms": summary["ttft_ms"].get("min"),
        "p50_ttft_ms": summary["ttft_ms"].get("p50"),
        "duration_s": summary["duration_s"],
    }


def run_http_cost(num_requests: int = 512, *, seed: int = 0, max_num_seqs: int = 128,
                  max_tokens: int | None = None, host_ms: float = 0.0, device_ms: float = 0.0,
                  profile_path: str | None = None) -> dict:
    """In-process and served tokens/s of one trace, and where the served run's CPU went."""

    # As `python -m orca_jax.serve` runs: both runs share this process, so both get them.
    gc_and_gil.shorten_gil_switch_interval()
    gc_and_gil.freeze_startup_heap()

    def engine() -> SyntheticEngine:
        return SyntheticEngine(max_num_seqs=max_num_seqs, max_waiting=max(4096, num_requests),
                               host_seconds=host_ms / 1e3, device_seconds=device_ms / 1e3)

    result = {"num_requests": num_requests, "seed": seed, "max_num_seqs": max_num_seqs,
              "max_tokens": max_tokens, "host_ms": host_ms, "device_ms": device_ms,
              "in_process_tokens_per_s": in_process_tokens_per_s(engine(), num_requests, seed, max_tokens)}
    result.update(served_run(engine(), num_requests, seed, max_tokens=max_tokens, profile_path=profile_path))
    result["served_over_in_process"] = result["served_tokens_per_s"] / result["in_process_tokens_per_s"]
    return result


def print_profile(profile_path: str, limit: int = 30) -> None:
    stats = pstats.Stats(profile_path)
    stats.sort_stats("tottime").print_stats(limit)
