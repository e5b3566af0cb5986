"""`bench latency`: a batch of identical requests, timed (the paper's Figure 9 microbenchmark), and decode
iterations against the weight-read bound.

Per batch size B (and async scheduling on or off):
- the batch's latency: B requests of --input-len prompt tokens and --output-len outputs, all at once,
  run --num-iters times after --num-iters-warmup;
- decode: B requests of --input-len prompt tokens, given outputs to spare, stepped until each has its
  first token; then the median wall time of --decode-steps iterations in which all B feed one token
  each (context about --input-len; --decode-repeats windows of fresh requests, each window's median and
  the quartiles of every step reported too), against the weight-read bound (every weight read once per
  iteration, each stage's share per device, stages in turn, at the copy bandwidth measured in this
  run); the requests are dropped after;
- the GPU's idle fraction: that decode's last batch replayed back to back on the device (forward and
  sampling, its context included, no host work between) over the engine's wall time per iteration.

docs/benchmarks.md's decode numbers (llama-8b, batch 1, 8, 32, context 512):
  python -m orca_jax.bench latency --model llama-8b --batch-size 1,8,32 --async-scheduling on,off --result-dir DIR
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from orca_jax.bench import roofline
from orca_jax.bench.datasets import identical_trace, int_list
from orca_jax.bench.driver import Probe, SchedulerKind, run_trace, use_scheduler
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, measured_engine, on_off
from orca_jax.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--batch-size", type=int_list, default=[1, 8, 32], help="a comma list runs each")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=20,
                        help="timed decode steps per batch size (every request one more token each)")
    parser.add_argument("--decode-repeats", type=int, default=1,
                        help="timed decode windows per batch size (fresh requests each); the row reports the "
                             "median of every step and each window's median (a host-bound step moves between windows)")
    add_result_arguments(parser)


def decode_seconds(engine, batch_size: int, input_len: int, steps: int) -> tuple[list[float], object]:
    """Wall seconds of `steps` decode steps of the batch, each until every one of batch_size requests
    has one more token (one engine iteration on one stage; on a pipeline the requests share out into a
    batch per stage, so a step is one iteration per stage), and the last decode batch
    (Probe.decode_batch). Each request gets enough outputs for all of them to be decoding together
    once the last prompt is in (prompts take several iterations when they exceed the token budget);
    they are dropped after."""
    budget = engine.config.scheduler.max_num_batched_tokens
    spare = -(-batch_size * input_len // budget) + 2  # iterations until every prompt is in, and one more
    trace = identical_trace(batch_size, input_len, steps + spare)
    ids = [engine.add_request(trace.prompt_ids(i, engine.model_config.vocab_size),
                              SamplingParams(max_tokens=steps + spare, ignore_eos=True)) for i in range(batch_size)]
    seen: set[str] = set()
    while len(seen) < batch_size:  # until every prompt is in and each has its first token
        seen.update(out.request_id for out in engine.step())
    times = []
    with Probe(engine) as probe:
        for _ in range(steps):
            start = time.perf_counter()
            waiting = set(ids)
            while waiting:
                waiting.difference_update(out.request_id for out in engine.step() if out.new_token_ids)
            times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return times, probe.decode_batch


def device_busy_ms(engine, batch, repeats: int = 20) -> float:
    """Forward + sampling of `batch` replayed back to back: the device's time for that iteration alone.
    Its requests have finished: it only rewrites K/V of free pages, and nothing runs meanwhile."""
    engine.drain()  # the runner is called from this thread below
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
    windows = []  # each window's step seconds
    for _ in range(max(1, args.decode_repeats)):
        window, batch = decode_seconds(engine, batch_size, args.input_len, args.decode_steps)
        windows.append(window)
    decode = [seconds for window in windows for seconds in window]
    quartiles = statistics.quantiles(decode, n=4) if len(decode) > 1 else decode * 3
    row = {"batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
           "batch_latency_s": statistics.median(r.wall_s for r in runs), "batch_latencies_s": [r.wall_s for r in runs],
           "roofline": roofline.run_bound(costs, peaks, runs[-1].records, runs[-1].wall_s),
           "decode_iterations": len(decode), "ms_per_iteration": 1e3 * statistics.median(decode),
           "ms_per_iteration_quartiles": [1e3 * q for q in quartiles],
           "ms_per_iteration_windows": [1e3 * statistics.median(window) for window in windows]}
    if batch is not None and batch.num_real_seqs == batch_size:
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
            row["fraction_of_bound"] = weight_bound_ms / row["ms_per_iteration"]
            rows.append(row)
            results.section("rows", rows)
            low, _, high = row["ms_per_iteration_quartiles"]
            windows = "" if len(row["ms_per_iteration_windows"]) < 2 else \
                ", windows " + " / ".join(f"{ms:.2f}" for ms in row["ms_per_iteration_windows"])
            print(f"batch {batch_size}, async {on_off(overlap)}: {row['ms_per_iteration']:.2f} ms per "
                  f"decode iteration (quartiles {low:.2f}-{high:.2f}{windows}; weight-read bound {weight_bound_ms:.2f} ms), "
                  f"batch {row['batch_latency_s']:.3f} s, idle {row.get('idle_fraction', float('nan')):.2f}", flush=True)
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    return {"decode and batch latency": [
        {"async": on_off(r["async_scheduling"]), "batch": r["batch_size"], "input": r["input_len"],
         "output": r.get("output_len"), "decode ms/it": r.get("ms_per_iteration"), "bound ms": r.get("weight_bound_ms"),
         "of bound": r.get("fraction_of_bound"), "idle": r.get("idle_fraction"), "batch latency s": r.get("batch_latency_s"),
         "batch of roofline": (r.get("roofline") or {}).get("fraction_of_bound")} for r in result.get("rows", [])]}
