"""The engine-core benchmark: one model, one process, every number next to its bound.

`python -m orca_jax.bench core --model llama-8b --out DIR` measures, in one run on one GPU:
- cold start: process start -> every bucket compiled, with an empty and with a warm compilation
  cache (two child processes), and the program count;
- decode time per iteration at batch 1, 8 and 32 (context ~512) against the weight-read bound
  (weight bytes / the copy bandwidth measured in this run);
- offline throughput on the paper's uniform trace and on its homogeneous trace (Figure 11), the
  trace's roofline bound from a host replay of the same schedule, and fed/real tokens;
- the GPU's idle fraction between iterations with async scheduling (host/device overlap) on and off:
  device time of the batch-32 decode's last batch (context ~512) replayed back to back, over the
  engine's wall time per batch-32 decode iteration;
- the uniform trace replayed twice through `python -m orca_jax.serve` (http_replay.py): programs
  compiled while serving (must be none) and throughput over the in-process figure;
- transformers' continuous batching on the same uniform trace (its own process; --no-hf skips).
Results go to DIR/<model>_core.json.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
import numpy as np

from orca_jax.bench import profile_summary, roofline
from orca_jax.bench.driver import Probe
from orca_jax.bench.traces import LengthSpec, Trace, TraceKind, make_trace
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.kv_cache import KVCacheManager
from orca_jax.models.loader import LoadedModel
from orca_jax.models.presets import PRESETS
from orca_jax.request import Request, SamplingParams
from orca_jax.scheduler import Scheduler
from orca_jax.tokenizer import ByteTokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class CoreSetup:
    """The engine shape every section uses (the issue's: 128 sequences, 2048 tokens per iteration)."""

    model: str
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    num_requests: int = 512
    kv_gib: float | None = None  # None: the runner's share of free memory
    dtype: str = "bfloat16"
    lengths: LengthSpec = LengthSpec()  # the paper's: prompts U(32, 512), outputs U(1, 128); 128 x 32


def random_model(model: str, dtype: str) -> LoadedModel:
    config = dataclasses.replace(PRESETS[model], dtype=dtype)
    return LoadedModel(config, None, ByteTokenizer(config.eos_token_ids, config.bos_token_id))


def engine_config(setup: CoreSetup, async_scheduling: bool = True, **overrides) -> EngineConfig:
    return EngineConfig(model=setup.model, dtype=setup.dtype,
                        cache=CacheConfig(kv_memory_gib=setup.kv_gib),
                        scheduler=SchedulerConfig(max_num_seqs=setup.max_num_seqs,
                                                  max_num_batched_tokens=setup.max_num_batched_tokens,
                                                  max_waiting=max(4096, setup.num_requests),
                                                  async_scheduling=async_scheduling),
                        **overrides)


def greedy(max_tokens: int) -> SamplingParams:
    """The paper's requests: greedy, exactly max_tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_trace(engine: Engine, trace: Trace, sampling: Callable[[int], SamplingParams] = greedy) -> dict:
    """All requests at t=0 (offline), each with sampling(its max_tokens); generated tokens per second
    over the drain, and the host's time split into scheduling, batch building, dispatch, update and
    the rest (outputs)."""
    vocab = engine.model_config.vocab_size
    before = engine.stats()
    with Probe(engine) as probe:
        start = time.perf_counter()
        for i, r in enumerate(trace.requests):
            engine.add_request(trace.prompt_ids(i, vocab), sampling(r.max_tokens))
        generated = 0
        while engine.has_unfinished():
            generated += sum(len(out.new_token_ids) for out in engine.step())
        seconds = time.perf_counter() - start
    after = engine.stats()
    iterations = after.iterations - before.iterations
    host_s = after.host_seconds_total - before.host_seconds_total
    split = {f"{name}_s": sum(getattr(record, f"{name}_s") for record in probe.records)
             for name in ("schedule", "build", "dispatch", "update")}
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "iterations": iterations, "ms_per_iteration": 1e3 * seconds / max(iterations, 1),
            "host_s": host_s, "host_split": split | {"rest_s": host_s - sum(split.values())},
            "device_wait_s": after.device_wait_seconds_total - before.device_wait_seconds_total}


def trace_bound(setup: CoreSetup, engine: Engine, trace: Trace, peaks: roofline.Peaks) -> dict:
    """The roofline bound of the trace's schedule, replayed on the host with the engine's own scheduler."""
    config = engine.model_config
    max_len = max(r.prompt_len + r.max_tokens for r in trace.requests)
    kv = KVCacheManager(len(trace.requests) * -(-max_len // 16) + 1, 16)
    scheduler = Scheduler(engine.config.scheduler, kv, config.max_seq_len, token_target=engine.buckets.token_target)
    for i, r in enumerate(trace.requests):
        scheduler.add_request(Request(str(i), [5] * r.prompt_len,
                                      SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), arrival_time=float(i)))
    costs = roofline.ModelCosts.of(config)
    bound = fed = real = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        q = np.array([s.num_new_tokens for s in output.scheduled], np.int64)
        k = np.array([s.request.num_computed_tokens for s in output.scheduled], np.int64) + q
        memory, compute = roofline.iteration_bound(costs, peaks, int(q.sum()), len(q), int(k.sum()),
                                                   int((q * k - q * (q - 1) // 2).sum()))
        bound += max(memory, compute)
        real += int(q.sum())
        fed += engine.buckets.bucket(int(q.sum()), len(q), 1)[0]
        scheduler.update(output, [7] * output.num_requests)
    generated = sum(r.max_tokens for r in trace.requests)
    return {"bound_s": bound, "bound_tokens_per_s": generated / bound, "fed_over_real": fed / real}


def decode_latency(engine: Engine, batch_size: int, context: int = 512, steps: int = 20,
                   observer=None) -> dict:
    """Median wall time of an iteration where batch_size requests each feed one token; `observer`
    (an EngineObserver) sees the timed iterations only."""
    vocab = engine.model_config.vocab_size
    context = min(context, engine.max_model_len - steps - 8)
    rng = np.random.default_rng(batch_size)
    ids = [engine.add_request(rng.integers(3, vocab, context).tolist(),
                              SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for _ in range(batch_size)]
    seen: set[str] = set()
    while len(seen) < batch_size:  # until every prompt is in and each has its first token
        seen.update(out.request_id for out in engine.step())
    times = []
    if observer is not None:
        engine.add_observer(observer)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if observer is not None:
        engine.remove_observer(observer)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return {"batch_size": batch_size, "context": context, "ms_per_iteration": 1e3 * statistics.median(times)}


class _LastDispatch:
    """An engine observer that keeps the last batch dispatched."""

    batch = None

    def on_dispatch(self, batch, timing) -> None:
        self.batch = batch

    def on_update(self, output, seconds) -> None:
        pass


def device_busy_ms(engine: Engine, batch) -> float:
    """Forward + sampling of `batch` (a real decode batch, its context included) replayed back to
    back: the device's time for that iteration alone, with no host work between."""
    jax.block_until_ready(engine.runner.execute(batch))
    start = time.perf_counter()
    for _ in range(20):
        out = engine.runner.execute(batch)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / 20


def profile_window(engine: Engine, trace: Trace, directory: str, iterations: int = 30, skip: int = 3) -> dict:
    """A jax profiler trace (perfetto's trace.json.gz under `directory`) of `iterations` iterations of
    the trace after the first `skip` (the first are prefill-heavy, later ones mostly decode); then
    the requests are dropped."""
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(trace.prompt_ids(i, vocab), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
           for i, r in enumerate(trace.requests)]
    for _ in range(max(skip, 1)):  # at least past the first dispatch, into the steady pipeline
        engine.step()
    # No Python tracer: it slows the host several-fold, and host speed is what the window is about.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(directory, create_perfetto_trace=True, profiler_options=options)
    start = time.perf_counter()
    for _ in range(iterations):
        engine.step()
    seconds = time.perf_counter() - start
    jax.profiler.stop_trace()
    # perfetto's file sits four folders down; a copy beside the results is easier to carry off.
    traces = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True))
    perfetto = f"{directory}.perfetto.json.gz" if traces else None
    if traces:
        shutil.copyfile(traces[-1], perfetto)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return {"directory": directory, "perfetto": perfetto, "iterations": iterations, "skipped": skip,
            "ms_per_iteration": 1e3 * seconds / iterations,
            "summary": None if perfetto is None else profile_summary.summarize(perfetto)}


def cold_start(setup: CoreSetup, cache_dir: str) -> dict:
    """Two child processes with cache_dir (empty at first): the empty-cache start, then the warm one."""
    runs = []
    for label in ("empty_cache", "warm_cache"):
        cmd = [sys.executable, "-m", "orca_jax.bench", "core-start", "--model", setup.model,
               "--max-num-seqs", str(setup.max_num_seqs),
               "--max-num-batched-tokens", str(setup.max_num_batched_tokens), "--cache-dir", cache_dir]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            runs.append({"label": label, "error": proc.stderr[-2000:]})
            continue
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append({"label": label, "process_to_ready_s": wall, **child})
    return {"runs": runs}


def start_probe(setup: CoreSetup, cache_dir: str) -> dict:
    """What `core-start` prints: the engine built and every program compiled, timed inside the child,
    with where the time went (weights, compiling by program kind, first runs, executable cache)."""
    start = time.perf_counter()
    engine = Engine(engine_config(setup, compilation_cache_dir=cache_dir, precompile=False),
                    random_model(setup.model, setup.dtype))
    built = time.perf_counter()
    done_at: dict[str, list[float]] = {}

    def progress(done: int, total: int, key: tuple, seconds: float) -> None:
        done_at.setdefault(key[0], []).append(seconds)

    cpu_before = _process_cpu_seconds()
    report = engine.precompile(progress)
    cpu_s = _process_cpu_seconds() - cpu_before
    cache = engine.runner.compilation.executable_cache
    program_s: dict[str, list[float]] = {}
    for key, seconds in report.seconds_by_key.items():
        program_s.setdefault(key[0], []).append(seconds)
    slowest = sorted(report.seconds_by_key.items(), key=lambda item: -item[1])[:5]
    return {"engine_ready_s": time.perf_counter() - start, "engine_built_s": built - start,
            "num_programs": engine.runner.compilation.num_compiled_programs, "params_init_s": engine.runner.params_seconds,
            "compile_s": report.compile_seconds, "first_runs_s": report.warm_seconds,
            # CPU seconds of the whole process over the precompile's wall time: the cores kept busy
            # (XLA's own threads included); well below the core count means the compiles wait on each other.
            "precompile_cpu_s": cpu_s, "precompile_cores_busy": cpu_s / (report.compile_seconds + report.warm_seconds),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "last_done_at_s": {kind: max(times) for kind, times in done_at.items()},
            # Per kind: programs, the sum of their own times (over compile_s: the parallelism), the longest.
            "program_s": {kind: {"count": len(t), "sum": sum(t), "max": max(t)} for kind, t in program_s.items()},
            "slowest": [[list(key), seconds] for key, seconds in slowest],
            "executable_cache": None if cache is None else {"hits": cache.hits, "misses": cache.misses}}


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_core(setup: CoreSetup, out_dir: str, sections=("cold_start", "engine", "http", "hf"),
             hf_timeout_s: float = 400.0, cache_dir: str | None = None, profile: bool = False,
             profile_skip: int = 3) -> dict:
    """The sections asked for, in order; the JSON is rewritten after each, so a cut-off run keeps what
    it got. Every section compiles into cache_dir (None: a fresh temporary one), so the cold start
    fills it and the engine sections after it start warm. `profile`: a profiler trace of the uniform
    trace's first iterations in each engine section, under out_dir/profile_<section>."""
    if cache_dir is None:
        cache_dir = tempfile.mkdtemp(prefix="orca_jax_cache_")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{setup.model}_core.json")
    result: dict = {"setup": dataclasses.asdict(setup) | {"lengths": str(setup.lengths)},
                    "device": jax.devices()[0].device_kind,
                    "command": " ".join(sys.argv)}

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    # Child processes first: once this process has run an engine, jax's allocator keeps the memory,
    # and a server or transformers started after it would find too little (the server ran out).
    if "cold_start" in sections:
        result["cold_start"] = cold_start(setup, cache_dir)
        save()
    if "http" in sections:
        from orca_jax.bench.http_replay import http_replay
        result["http"] = http_replay(setup, cache_dir, os.path.join(out_dir, f"{setup.model}_core_server.log"),
                                     PRESETS[setup.model].vocab_size)
        save()
    if "hf" in sections:
        from orca_jax.bench.suite import run_hf_subprocess
        result["hf"] = run_hf_subprocess(setup.model, setup.num_requests, 0,
                                         os.path.join(out_dir, f"{setup.model}_core_hf.json"), hf_timeout_s,
                                         micro=False)
        save()
    peaks = roofline.measure_peaks()
    result["peaks"] = peaks.as_dict()
    # "engine" runs both; "async" or "sync" one of them.
    for overlap in [o for o in (True, False) if {"engine", "async" if o else "sync"} & set(sections)]:
        engine = Engine(engine_config(setup, async_scheduling=overlap, compilation_cache_dir=cache_dir),
                        random_model(setup.model, setup.dtype))
        label = "async_scheduling" if overlap else "sync_scheduling"
        section: dict = {"num_programs": engine.runner.compilation.num_compiled_programs}
        weight_bound_ms = 1e3 * engine.runner.params_bytes / peaks.hbm_bytes_per_s
        last = _LastDispatch()
        section["decode"] = [dict(decode_latency(engine, b, observer=last if b == 32 else None),
                                  weight_bound_ms=weight_bound_ms) for b in (1, 8, 32)]
        # The batch-32 decode's last timed iteration, replayed on the device: its pages were freed by
        # the aborts, and it only rewrites their K/V (nothing runs meanwhile).
        busy_ms = device_busy_ms(engine, last.batch)
        for kind in (TraceKind.UNIFORM, TraceKind.HOMOGENEOUS):
            trace = make_trace(kind, setup.num_requests, None, 0, setup.lengths)
            runs = [run_trace(engine, trace) for _ in range(2)]  # the second is the warm one
            bound = trace_bound(setup, engine, trace, peaks)
            warm = runs[-1]
            section[kind.value] = {"runs": runs, **bound,
                                   "fraction_of_bound": bound["bound_s"] / warm["seconds"]}
        if profile:
            section["profile"] = profile_window(engine, make_trace(TraceKind.UNIFORM, setup.num_requests, None, 0,
                                                                   setup.lengths),
                                                os.path.join(out_dir, f"profile_{label}"), skip=profile_skip)
        section["idle"] = {"ms_per_iteration_decode_b32": section["decode"][2]["ms_per_iteration"],
                           "device_busy_ms_b32": busy_ms}
        section["idle"]["idle_fraction"] = 1 - section["idle"]["device_busy_ms_b32"] / \
            section["idle"]["ms_per_iteration_decode_b32"]
        result[label] = section
        if overlap and "http" in result:
            result["http"]["warm_over_in_process"] = (result["http"]["runs"][-1]["output_throughput"]
                                                      / section["uniform"]["runs"][-1]["tokens_per_s"])
        save()
        del engine
    return result
