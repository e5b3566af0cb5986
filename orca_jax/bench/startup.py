"""`bench startup`: process start -> every program compiled, with an empty and with a warm compilation cache.

Each start is a child process (`bench startup --one-start`) that builds the engine and compiles every
program, timing both inside; the parent times the whole process. A cold start gets an empty cache
directory of its own; the warm ones share the last cold start's (after --num-iters-warmup more), so
they load every program from the executable cache (vLLM's --num-iters-cold/-warmup/-warm).

  python -m orca_jax.bench startup --model llama-8b --result-dir DIR
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, build_engine, engine_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--num-iters-cold", type=int, default=1)
    parser.add_argument("--num-iters-warmup", type=int, default=0)
    parser.add_argument("--num-iters-warm", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="of one start")
    parser.add_argument("--one-start", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    add_result_arguments(parser)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_start(args: argparse.Namespace) -> dict:
    """In the child: the engine built, then every program compiled; where the time went."""
    start = time.perf_counter()
    engine = build_engine(args, precompile=False)
    built = time.perf_counter()
    cpu = _cpu_seconds()
    report = engine.precompile()
    cpu = _cpu_seconds() - cpu
    by_kind: dict[str, list[float]] = {}
    for key, seconds in report.seconds_by_key.items():
        by_kind.setdefault(type(key).__name__, []).append(seconds)
    cache = engine.runner.compilation.executable_cache
    return {"engine_ready_s": time.perf_counter() - start, "engine_built_s": built - start,
            "num_programs": engine.stats().num_compiled_programs, "params_init_s": engine.runner.params_seconds,
            "compile_s": report.compile_seconds, "first_runs_s": report.warm_seconds,
            # The process's CPU seconds over the precompile's wall time: how many cores the compiles kept busy.
            "precompile_cpu_s": cpu, "precompile_cores_busy": cpu / max(report.compile_seconds + report.warm_seconds, 1e-9),
            "program_s": {kind: {"count": len(t), "sum": sum(t), "max": max(t)} for kind, t in by_kind.items()},
            "executable_cache": None if cache is None else {"hits": cache.hits, "misses": cache.misses}}


def _child(argv: list[str], cache_dir: str, label: str, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "orca_jax.bench", "startup", "--one-start", *argv, "--compilation-cache-dir", cache_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"label": label, "error": proc.stderr[-2000:]}
    return {"label": label, "process_to_ready_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def run(args: argparse.Namespace) -> Results | None:
    if args.one_start:
        print(json.dumps(one_start(args)), flush=True)
        return None
    results = Results("startup", args, args.model)
    argv, runs, dirs = engine_argv(args), [], []
    try:
        for i in range(args.num_iters_cold):
            dirs.append(tempfile.mkdtemp(prefix="orca_jax_startup_"))
            runs.append(_child(argv, dirs[-1], "cold", args.timeout_s))
            results.section("runs", runs)
        warm_dir = dirs[-1] if dirs else tempfile.mkdtemp(prefix="orca_jax_startup_")
        dirs.append(warm_dir)
        for label, count in (("warmup", args.num_iters_warmup), ("warm", args.num_iters_warm)):
            for _ in range(count):
                runs.append(_child(argv, warm_dir, label, args.timeout_s))
                results.section("runs", runs)
    finally:
        for directory in set(dirs):
            shutil.rmtree(directory, ignore_errors=True)
    for r in runs:
        print(f"{r['label']}: " + (f"{r['process_to_ready_s']:.1f} s to ready, {r['num_programs']} programs"
                                   if "error" not in r else f"failed: {r['error'][-300:]}"), flush=True)
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    return {"starts": [{"start": r["label"], "process to ready s": r.get("process_to_ready_s"), "programs": r.get("num_programs"),
             "engine built s": r.get("engine_built_s"), "compile s": r.get("compile_s"),
             "cores busy": r.get("precompile_cores_busy"), "error": (r.get("error") or "")[-80:] or None}
            for r in result.get("runs", [])]}
