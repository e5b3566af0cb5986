"""One model at several (tensor parallel, pipeline stages) meshes: ORCA's intra- and inter-layer split.

For each mesh: offline throughput on the paper's trace with n_stages batches in flight (ORCA) and
with one (what a pipeline without iteration-level overlap gets), and the decode time per iteration
of one batch of 1, 8, 32 requests against the weight-read bound (every weight read once per
iteration: weight bytes / (tp x HBM bandwidth), the stages running one after another for one batch).
A mesh needing more devices than are visible is recorded as skipped.
"""

from __future__ import annotations

import gc
import json
import os
import time

import jax

from orca_jax.batch import BucketPolicy
from orca_jax.bench import driver, roofline
from orca_jax.bench.traces import LengthSpec, TraceKind, identical_trace, make_trace
from orca_jax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from orca_jax.engine import Engine

MESHES = ((1, 1), (2, 1), (1, 2))  # (tensor parallel, stages)
BATCH_SIZES = (1, 8, 32)


def _pow2s(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] < hi:
        out.append(min(out[-1] * 2, hi))
    return out


def bucket_keys(buckets: BucketPolicy, max_kv_tokens: int, page_size: int) -> list[tuple]:
    """Every forward bucket a run up to max_kv_tokens per request can meet, and greedy sampling's."""
    pages = _pow2s(4, max(4, -(-max_kv_tokens // page_size)))
    tokens = _pow2s(8, buckets.max_tokens)
    keys = [("forward", t, min(t, buckets.max_num_seqs), p) for t in tokens for p in pages]
    return keys + [("sample", min(t, buckets.max_num_seqs), 0, True) for t in tokens]


def measure_mesh(model: str, tp: int, pp: int, trace, peaks: roofline.Peaks, *, max_batch: int,
                 token_budget: int, kv_gib: float | None, batch_sizes, decode_tokens: int) -> dict:
    config = EngineConfig(model=model, cache=CacheConfig(page_size=16, kv_memory_gib=kv_gib),
                          scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=token_budget),
                          parallel=ParallelConfig(num_stages=pp, tensor_parallel=tp))
    engine = Engine(config)
    runner = engine.runner
    longest = max(r.prompt_len + r.max_tokens for r in trace.requests)
    report = runner.precompile(bucket_keys(engine.buckets, max(longest, 32 + decode_tokens), runner.page_size))
    costs = roofline.ModelCosts.of(engine.model_config)
    row = {"tp": tp, "pp": pp, "kv_pages": runner.num_pages, "params_bytes": runner.params_bytes,
           "compile_s": report.compile_seconds, "num_programs": runner.num_compiled_programs}
    for in_flight in sorted({pp, 1}, reverse=True):
        driver.use_scheduler(engine, driver.ORCA, max_batch, batches_in_flight=in_flight)
        before = engine.stats().in_flight_total, engine.stats().iterations
        summary = driver.run_trace(engine, trace, f"orca-{tp}x{pp}-{in_flight}", realtime=False).summary()
        stats = engine.stats()
        summary["mean_in_flight"] = ((stats.in_flight_total - before[0])
                                             / max(stats.iterations - before[1], 1))
        row[f"trace_in_flight_{in_flight}"] = summary
    bound_s = costs.weight_bytes / tp / peaks.hbm_bytes_per_s
    row["decode"] = []
    for bs in batch_sizes:
        if bs > max_batch:
            continue
        driver.use_scheduler(engine, driver.ORCA, bs, batches_in_flight=1)
        run = driver.run_trace(engine, identical_trace(bs, 32, decode_tokens), f"decode-{bs}", realtime=False)
        # One iteration feeds the 32-token prompts, the other decode_tokens - 1 one token per request.
        decode_s = run.wall_s / run.iterations
        row["decode"].append({"batch_size": bs, "s_per_iteration": decode_s, "weight_read_bound_s": bound_s,
                              "bound_fraction": bound_s / decode_s})
    del engine, runner
    gc.collect()
    return row


def run_parallel(model: str, out_dir: str, meshes=MESHES, num_requests: int = 256, seed: int = 0,
                 max_batch: int = 32, token_budget: int = 512, kv_gib: float | None = 40.0,
                 batch_sizes=BATCH_SIZES, decode_tokens: int = 64, lengths: LengthSpec = LengthSpec()) -> dict:
    """Measure every mesh that fits the visible devices; writes <out_dir>/<model>_parallel.json."""
    trace = make_trace(TraceKind.UNIFORM, num_requests, None, seed, lengths)
    peaks = roofline.measure_peaks()
    result = {"model": model, "devices": [str(d) for d in jax.devices()], "peaks": peaks.as_dict(),
              "trace": {"num_requests": num_requests, "seed": seed}, "meshes": []}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{model}_parallel.json")
    for tp, pp in meshes:
        start = time.perf_counter()
        if tp * pp > len(jax.devices()):
            row = {"tp": tp, "pp": pp, "skipped": f"needs {tp * pp} devices, {len(jax.devices())} visible"}
        else:
            row = measure_mesh(model, tp, pp, trace, peaks, max_batch=max_batch, token_budget=token_budget,
                               kv_gib=kv_gib, batch_sizes=batch_sizes, decode_tokens=decode_tokens)
        row["seconds"] = time.perf_counter() - start
        result["meshes"].append(row)
        with open(path, "w") as f:  # after every mesh, so a cut-off run keeps what it measured
            json.dump(result, f, indent=1)
    return result
