"""`bench latency`: a batch of identical requests, timed (the paper's Figure 9 microbenchmark), and its
decode iterations against the weight-read bound.

Per batch size B (and async scheduling on or off): B requests of --input-len prompt tokens and
--output-len outputs, all at once, run --num-iters times after --num-iters-warmup: the batch's latency,
and each decode iteration's wall time (every request past its prompt, one token each, context about
--input-len). Against them:
- the weight-read bound: every weight read once per iteration (each stage's share per device, stages
  in turn) at the copy bandwidth measured in this run;
- the GPU's idle fraction: the last decode batch replayed back to back on the device (forward and
  sampling, its context included, no host work between) over the engine's wall time per iteration.

The README's decode numbers (llama-8b, batch 1, 8, 32, context 512):
  python -m orca_jax.bench latency --model llama-8b --batch-size 1,8,32 --async-scheduling on,off --result-dir DIR
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from orca_jax.bench import roofline
from orca_jax.bench.datasets import identical_trace, int_list
from orca_jax.bench.driver import SchedulerKind, TraceRun, run_trace, use_scheduler
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, measured_engine, on_off


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--batch-size", type=int_list, default=[1, 8, 32], help="a comma list runs each")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    add_result_arguments(parser)


def decode_step_seconds(run: TraceRun) -> np.ndarray:
    """Wall seconds of each step that began once every request had its first token."""
    starts = np.concatenate([[0.0], run.step_end[:-1]])
    return (run.step_end - starts)[starts >= np.nanmax(run.first_token)]


def device_busy_ms(engine, batch, repeats: int = 20) -> float:
    """Forward + sampling of `batch` replayed back to back: the device's time for that iteration alone.
    Its requests have finished: it only rewrites K/V of free pages, and nothing runs meanwhile."""
    jax.block_until_ready(engine.runner.execute(batch))
    start = time.perf_counter()
    for _ in range(repeats):
        out = engine.runner.execute(batch)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / repeats


def measure(engine, batch_size: int, args: argparse.Namespace, costs, peaks) -> dict:
    trace = identical_trace(batch_size, args.input_len, args.output_len)
    for _ in range(args.num_iters_warmup):
        run_trace(engine, trace, realtime=False)
    runs = [run_trace(engine, trace, realtime=False) for _ in range(args.num_iters)]
    decode = np.concatenate([decode_step_seconds(r) for r in runs])
    row = {"batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
           "batch_latency_s": statistics.median(r.wall_s for r in runs), "batch_latencies_s": [r.wall_s for r in runs],
           "decode_iterations": int(decode.size),
           "ms_per_iteration": 1e3 * float(np.median(decode)) if decode.size else None,
           "roofline": roofline.run_bound(costs, peaks, runs[-1].records, runs[-1].wall_s)}
    batch = runs[-1].decode_batch
    if row["ms_per_iteration"] and batch is not None and batch.num_real_seqs == batch_size:
        row["device_busy_ms"] = device_busy_ms(engine, batch)
        row["idle_fraction"] = 1 - row["device_busy_ms"] / row["ms_per_iteration"]
    return row


def run(args: argparse.Namespace) -> Results:
    results = Results("latency", args, args.model)
    engine, peaks, costs = measured_engine(args, results)
    weight_bound_ms = results["engine"]["weight_bound_ms"]
    rows = []
    for overlap in args.async_scheduling:
        for batch_size in args.batch_size:
            use_scheduler(engine, SchedulerKind.ORCA, max_num_seqs=engine.config.scheduler.max_num_seqs,
                          async_scheduling=overlap)
            row = {"async_scheduling": overlap, **measure(engine, batch_size, args, costs, peaks),
                   "weight_bound_ms": weight_bound_ms}
            if row["ms_per_iteration"]:
                row["fraction_of_bound"] = weight_bound_ms / row["ms_per_iteration"]
            rows.append(row)
            results.section("rows", rows)
            print(f"batch {batch_size}, async {on_off(overlap)}: {row['ms_per_iteration'] or 0:.2f} ms per "
                  f"decode iteration (weight-read bound {weight_bound_ms:.2f} ms), batch "
                  f"{row['batch_latency_s']:.3f} s, idle {row.get('idle_fraction', float('nan')):.2f}", flush=True)
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    return {"decode and batch latency": [
        {"async": on_off(r["async_scheduling"]), "batch": r["batch_size"], "input": r["input_len"],
         "output": r.get("output_len"), "decode ms/it": r.get("ms_per_iteration"), "bound ms": r.get("weight_bound_ms"),
         "of bound": r.get("fraction_of_bound"), "idle": r.get("idle_fraction"), "batch latency s": r.get("batch_latency_s"),
         "batch of roofline": (r.get("roofline") or {}).get("fraction_of_bound")} for r in result.get("rows", [])]}
