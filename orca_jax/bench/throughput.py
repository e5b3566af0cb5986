"""`bench throughput`: generated tokens per second of one engine over datasets and scheduling choices.

One engine is built (every program compiled first), then each combination of dataset, scheduler
(ORCA's or the request-level baseline), batch cap, policy, async scheduling and batches in flight
runs --num-runs times on it; the last run is the one reported (the first warms up). All requests of
an offline dataset arrive at time 0 and generate exactly their max_tokens (EOS ignored, as in the
paper and in vLLM's offline benchmarks). For those, the schedule is also replayed on the host and
priced on the roofline (roofline.py), with peaks measured in the same process: "of the bound"
(`fraction_of_bound`) is the bound's time over the measured one, 1.0 being the device's measured
peak compute and memory bandwidth; a CPU, or a model too small to keep the device busy, runs far
below it (the host sets the pace). TCB's workload (--dataset-name tcb) counts time in iterations and
adds its total utility and deadline hit rate. Prompts and outputs are fitted to the model's context
before anything compiles (one line names the flags shortened).

On a CPU, in a few minutes (tiny-llama: random weights, a 512-token context):
  python -m orca_jax.bench throughput --model tiny-llama
The ORCA trace on llama-8b (docs/benchmarks.md's numbers):
  python -m orca_jax.bench throughput --model llama-8b --dataset-name uniform,homogeneous \\
      --async-scheduling on,off --result-dir DIR
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics

from orca_jax.bench import roofline
from orca_jax.bench.datasets import add_dataset_arguments, datasets_from_args, int_list
from orca_jax.bench.driver import IterationClock, SchedulerKind, run_trace, scheduler_factory, use_scheduler
from orca_jax.bench.harness import (Results, add_engine_arguments, add_result_arguments, fill_batch_defaults,
                                    measured_engine, on_off, replay_schedule)
from orca_jax.config import SchedulingPolicy


BOUND_LEGEND = ("of the bound: the time this schedule would take at the device's measured peak compute and memory "
                "bandwidth (roofline.py), over the time it took; 1.0 is the device's limit, and a CPU or a small "
                "model runs far below it (the host sets the pace)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, lists=True)
    add_dataset_arguments(parser)
    parser.add_argument("--scheduler", default=SchedulerKind.ORCA.value,
                        help="orca, request-level (a comma list runs each)")
    parser.add_argument("--num-runs", type=int, default=2,
                        help="runs of each combination; the last is reported, the ones before warm up")
    parser.add_argument("--interleave", action="store_true",
                        help="build every budget's engine first (--kv-cache-memory-gib each), then run the "
                        "combinations in rounds, one run each per round, so drift on the host spreads over "
                        "all of them; each row also reports the median of its runs")
    add_result_arguments(parser)


def configurations(args: argparse.Namespace) -> list[dict]:
    """Every scheduling combination the flags name; the request-level baseline has no policy or
    async scheduling, so it runs once per batch cap and batches in flight."""
    in_flight = [None] if args.max_in_flight is None else int_list(args.max_in_flight)
    out = []
    for kind, seqs, policy, overlap, flight in itertools.product(
            [SchedulerKind(k) for k in args.scheduler.split(",")], int_list(args.max_num_seqs),
            [SchedulingPolicy(p) for p in args.scheduling_policy.split(",")], args.async_scheduling, in_flight):
        config = {"scheduler": kind, "max_num_seqs": seqs, "policy": policy, "async_scheduling": overlap,
                  "max_in_flight": flight}
        if kind is SchedulerKind.REQUEST_LEVEL:
            config |= {"policy": SchedulingPolicy.FCFS, "async_scheduling": False}
        if config not in out:
            out.append(config)
    return out


def run_configuration(engine, trace, config: dict, num_runs: int) -> list[dict]:
    """num_runs runs of one trace under one scheduling configuration; their summaries."""
    options = dict(max_num_seqs=config["max_num_seqs"], async_scheduling=config["async_scheduling"],
                   max_in_flight=config["max_in_flight"], policy=config["policy"])
    runs = []
    for _ in range(num_runs):
        clock = IterationClock() if trace.time_unit == "iteration" else None
        use_scheduler(engine, config["scheduler"], **options, **({"clock": clock} if clock else {}))
        runs.append(run_trace(engine, trace, realtime=trace.rate is not None, clock=clock).summary())
    return runs


def offline_bound(engine, trace, config: dict, costs, peaks) -> dict:
    """The roofline time of this configuration's schedule of the trace, replayed on the host with the
    engine's pool and length cap (so with one batch in flight it is the engine's own schedule)."""
    factory = scheduler_factory(engine, config["scheduler"], max_num_seqs=config["max_num_seqs"],
                                async_scheduling=config["async_scheduling"], policy=config["policy"])
    lengths = [(r.prompt_len, r.max_tokens) for r in trace.requests]
    replayed = replay_schedule(factory, lengths, engine.buckets, engine.kv.page_size, engine.max_model_len, engine.kv.num_pages)
    bound = roofline.schedule_bound(costs, peaks, replayed)
    return bound | {"bound_tokens_per_s": trace.num_generated_tokens / bound["bound_s"]}


def run(args: argparse.Namespace) -> Results:
    """Every combination on one engine per token budget (a list of budgets sweeps the batch shape)."""
    fill_batch_defaults(args)
    if args.interleave:
        return run_interleaved(args)
    results = Results("throughput", args, args.model)
    rows, engines, peaks = [], [], None
    for budget in int_list(str(args.max_num_batched_tokens)):
        configs = [c for c in configurations(args) if c["max_num_seqs"] <= budget]
        engine = None  # the last budget's engine is dropped before the next one sizes its pool
        engine, peaks, costs = measured_engine(args, results, peaks, max_num_batched_tokens=budget,
                                               max_num_seqs=max(c["max_num_seqs"] for c in configs))
        engines.append(results["engine"])
        results.section("engines", engines)
        for dataset in datasets_from_args(args):
            for config in configs:
                trace = dataset.trace(config["max_num_seqs"])
                row = _row(trace, config, budget)
                row["runs"] = run_configuration(engine, trace, config, args.num_runs)
                _finish_row(row, engine, trace, config, costs, peaks)
                rows.append(row)
                results.section("runs", rows)
                print(describe_row(row), flush=True)
        del engine
        gc.collect()
    print(BOUND_LEGEND, flush=True)
    return results


def run_interleaved(args: argparse.Namespace) -> Results:
    """--interleave: all engines alive at once, --num-runs rounds over every (budget, dataset, config)."""
    if args.kv_cache_memory_gib is None:
        raise SystemExit("--interleave keeps every budget's engine alive: give each a pool with --kv-cache-memory-gib")
    results = Results("throughput", args, args.model)
    points, engines, peaks = [], [], None
    for budget in int_list(str(args.max_num_batched_tokens)):
        configs = [c for c in configurations(args) if c["max_num_seqs"] <= budget]
        engine, peaks, costs = measured_engine(args, results, peaks, max_num_batched_tokens=budget,
                                               max_num_seqs=max(c["max_num_seqs"] for c in configs))
        engines.append(results["engine"])
        for dataset in datasets_from_args(args):
            for config in configs:
                trace = dataset.trace(config["max_num_seqs"])
                points.append((engine, trace, config, _row(trace, config, budget) | {"runs": []}))
    results.section("engines", engines)
    for _ in range(args.num_runs):
        for engine, trace, config, row in points:
            row["runs"] += run_configuration(engine, trace, config, 1)
    rows = []
    for engine, trace, config, row in points:
        _finish_row(row, engine, trace, config,
                    roofline.ModelCosts.of(engine.model_config).per_device(engine.runner.num_devices), peaks)
        rows.append(row)
        print(describe_row(row), flush=True)
    results.section("runs", rows)
    print(BOUND_LEGEND, flush=True)
    return results


def _row(trace, config: dict, budget: int) -> dict:
    return {"dataset": trace.describe(), **{k: getattr(v, "value", v) for k, v in config.items()},
            "max_num_batched_tokens": budget}


def _finish_row(row: dict, engine, trace, config: dict, costs, peaks) -> None:
    """The offline bound against the reported (last) run, and the median of the runs."""
    last = row["runs"][-1]
    unit = "s" if trace.time_unit == "s" else "iteration"
    row[f"median_tokens_per_{unit}"] = statistics.median(r[f"tokens_per_{unit}"] for r in row["runs"])
    if trace.rate is None:
        row |= offline_bound(engine, trace, config, costs, peaks)
        row["fraction_of_bound"] = row["bound_s"] / last["wall_s"]


def describe_row(row: dict) -> str:
    last = row["runs"][-1]
    rate = (f"{last['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in last
            else f"{last['tokens_per_iteration']:.1f} tokens/iteration")
    text = (f"{row['dataset']['kind']}: {row['scheduler']} max_num_seqs={row['max_num_seqs']} "
            f"max_num_batched_tokens={row.get('max_num_batched_tokens')} policy={row['policy']} "
            f"async={on_off(row['async_scheduling'])}: {rate}, {last['iterations']} iterations, "
            f"mean batch {last['mean_batch_size']:.1f}")
    if len(row["runs"]) > 1 and "median_tokens_per_s" in row:
        text += f" (median of {len(row['runs'])} runs {row['median_tokens_per_s']:,.0f})"
    if "fraction_of_bound" in row:
        text += f", {row['fraction_of_bound']:.3f} of the bound ({row['bound_tokens_per_s']:,.0f} tok/s)"
    if "utility" in last:
        text += f", utility {last['utility']:.3f} of {last['max_utility']:.3f}, hit rate {last['hit_rate']:.2f}"
    return text


def tables(result: dict) -> dict[str, list[dict]]:
    """One row per configuration (its reported run), for `bench report`."""
    rows = []
    for row in result.get("runs", []):
        last, dataset = row["runs"][-1], row["dataset"]
        per_it = 1e3 / max(last.get("iterations") or 1, 1)
        split = last.get("host_split") or {}
        rows.append({"dataset": " ".join([dataset["kind"]] + [f"{k}={dataset[k]}" for k in ("variance", "load", "deadlines")
                                                              if k in dataset] + [dataset.get("note", "")]).strip(),
                     "requests": dataset.get("num_requests"), "scheduler": row["scheduler"],
                     "max_num_seqs": row["max_num_seqs"], "policy": row["policy"], "async": on_off(row["async_scheduling"]),
                     "in_flight": row.get("max_in_flight"), "tok/s": last.get("tokens_per_s"),
                     "tok/iteration": last.get("tokens_per_iteration"), "bound tok/s": row.get("bound_tokens_per_s"),
                     "of bound": row.get("fraction_of_bound"), "fed/real": last.get("fed_over_real"),
                     "mean batch": last.get("mean_batch_size"),
                     "dispatch ms/it": split["dispatch_s"] * per_it if split else None,
                     "other host ms/it": (last["host_s"] - split["dispatch_s"]) * per_it if split else None,
                     "utility": last.get("utility"), "of max utility": last["utility"] / last["max_utility"]
                     if "utility" in last else None, "hit rate": last.get("hit_rate")})
    return {"runs": rows}
