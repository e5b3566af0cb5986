"""`bench sweep`: median normalized latency vs throughput over arrival rates (the paper's Figure 10).

Each point replays a short Poisson trace of the paper's lengths in real time (the same seed, so the
same requests at every rate) through one configuration: ORCA's scheduler or the request-level
baseline at some batch cap, all on one engine. Rates are --request-rate, or --rate-fractions of a
capacity (--capacity, else measured: ORCA's offline requests/s at the largest batch cap). A
configuration stops at the first rate where it is clearly saturated: it completed requests at less
than --keep-up x the arrival rate, or its median normalized latency passed --saturation-factor x its
first point's. Then each scheduler's best throughput under latency targets set as multiples of
ORCA's lowest latency (at its best batch cap) gives the paper's comparison.

  python -m orca_jax.bench sweep --model llama-8b --scheduler orca,request-level --max-num-seqs 32,128 --result-dir DIR
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from orca_jax.bench import roofline
from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, float_list, int_list, lengths_from_args, make_trace
from orca_jax.bench.driver import SchedulerKind, run_trace, use_scheduler
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, measured_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, lists=True)
    add_dataset_arguments(parser, num_prompts=256, lists=False, names=(DatasetName.UNIFORM, DatasetName.SHAREGPT_LIKE))
    parser.add_argument("--scheduler", default="orca,request-level", help="a comma list runs each")
    parser.add_argument("--request-rate", type=float_list, default=None, help="requests/s, a comma list")
    parser.add_argument("--capacity", type=float, default=None, help="requests/s the --rate-fractions scale")
    parser.add_argument("--rate-fractions", type=float_list, default=[0.15, 0.35, 0.6, 0.85, 1.1])
    parser.add_argument("--point-seconds", type=float, default=5.0, help="about this much arrival time per point")
    parser.add_argument("--min-point-prompts", type=int, default=48)
    parser.add_argument("--max-point-prompts", type=int, default=150)
    parser.add_argument("--max-point-seconds", type=float, default=60.0, help="a point still running is cut")
    parser.add_argument("--keep-up", type=float, default=0.75)
    parser.add_argument("--saturation-factor", type=float, default=8.0)
    add_result_arguments(parser)


def throughput_at_latency(points: list[dict], target: float) -> float:
    """Highest throughput (req/s) at which median normalized latency stays <= target, interpolating
    linearly between the last point under the target and the next one over it; 0 if none is under."""
    ok = sorted((p for p in points if "error" not in p), key=lambda p: p["rate"])
    best = 0.0
    for lo, hi in zip([None] + ok[:-1], ok):
        if hi["median_norm_latency_s"] <= target:
            best = max(best, hi["requests_per_s"])
        elif lo is not None and lo["median_norm_latency_s"] <= target:
            frac = (target - lo["median_norm_latency_s"]) / (hi["median_norm_latency_s"] - lo["median_norm_latency_s"])
            best = max(best, lo["requests_per_s"] + frac * (hi["requests_per_s"] - lo["requests_per_s"]))
    return best


def compare_at_matched_latency(points: list[dict], multiples=(2.0, 4.0, 8.0)) -> list[dict]:
    """Best throughput of each scheduler (over its batch caps) under latency targets set as multiples of
    ORCA's lowest median normalized latency; the ratio is ORCA's over the baseline's."""
    ok = [p for p in points if "error" not in p]
    groups = {kind: [p for p in ok if p["scheduler"] == kind.value] for kind in SchedulerKind}
    if not all(groups.values()):
        return []
    floor = min(p["median_norm_latency_s"] for p in groups[SchedulerKind.ORCA])
    rows = []
    for multiple in multiples:
        best = {}
        for kind, group in groups.items():
            per_cap = {cap: throughput_at_latency([p for p in group if p["max_num_seqs"] == cap], multiple * floor)
                       for cap in sorted({p["max_num_seqs"] for p in group})}
            best[kind.value] = {"requests_per_s": max(per_cap.values()), "max_num_seqs": max(per_cap, key=per_cap.get),
                                "per_max_num_seqs": per_cap}
        orca, base = (best[k.value]["requests_per_s"] for k in SchedulerKind)
        rows.append({"latency_target_s_per_token": multiple * floor, "multiple_of_orca_floor": multiple, **best,
                     "ratio": orca / base if base > 0 else (float("inf") if orca > 0 else None)})
    return rows


def run(args: argparse.Namespace) -> Results:
    results = Results("sweep", args, args.model)
    engine, peaks, costs = measured_engine(args, results)
    lengths, name = lengths_from_args(args), DatasetName(args.dataset_name)
    caps = int_list(args.max_num_seqs)
    rates = args.request_rate
    if rates is None:
        capacity = args.capacity
        if capacity is None:  # ORCA's offline requests/s at its largest cap
            use_scheduler(engine, SchedulerKind.ORCA, max_num_seqs=max(caps), async_scheduling=args.async_scheduling[0])
            trace = make_trace(name, args.num_prompts, None, args.seed, lengths)
            capacity = run_trace(engine, trace, realtime=False).summary()["requests_per_s"]
        rates = [float(np.round(capacity * f, 3)) for f in args.rate_fractions]
        results["capacity_requests_per_s"] = capacity
    results.section("rates", rates)
    points = []
    for kind, cap in itertools.product([SchedulerKind(k) for k in args.scheduler.split(",")], caps):
        first_latency = None
        for rate in sorted(rates):
            n = int(min(args.max_point_prompts, max(args.min_point_prompts, round(rate * args.point_seconds))))
            trace = make_trace(name, n, rate, args.seed, lengths)
            use_scheduler(engine, kind, max_num_seqs=cap, async_scheduling=args.async_scheduling[0])
            point = {"scheduler": kind.value, "max_num_seqs": cap, "rate": rate}
            try:
                measured = run_trace(engine, trace, max_seconds=args.max_point_seconds)
            except TimeoutError as err:
                points.append(point | {"error": str(err)})
                break
            point |= measured.summary() | {"roofline": roofline.run_bound(costs, peaks, measured.records, measured.wall_s)}
            points.append(point)
            results.section("points", points)
            print(f"{kind.value} max_num_seqs={cap} at {rate:g} req/s: {point['requests_per_s']:.2f} req/s done, "
                  f"median normalized latency {1e3 * point['median_norm_latency_s']:.1f} ms/token", flush=True)
            latency = point["median_norm_latency_s"]
            first_latency = latency if first_latency is None else first_latency
            if point["requests_per_s"] < args.keep_up * rate or latency > args.saturation_factor * first_latency:
                break
    results.section("points", points)
    results.section("matched_latency", compare_at_matched_latency(points))
    for row in results["matched_latency"]:
        print(f"at {row['multiple_of_orca_floor']:g}x ORCA's latency floor: ORCA / request-level = {row['ratio']}")
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    points = [{"scheduler": p["scheduler"], "max_num_seqs": p["max_num_seqs"], "rate": p["rate"],
               "req/s done": p.get("requests_per_s"), "median norm. latency ms/tok":
               None if "error" in p else 1e3 * p["median_norm_latency_s"],
               "TTFT p50 ms": None if "error" in p else 1e3 * p["ttft_s"]["p50"],
               "of bound": (p.get("roofline") or {}).get("fraction_of_bound"), "error": p.get("error")}
              for p in result.get("points", [])]
    matched = [{"latency target ms/tok": 1e3 * m["latency_target_s_per_token"],
                "x ORCA's floor": m["multiple_of_orca_floor"],
                "orca req/s (cap)": f"{m['orca']['requests_per_s']:.2f} ({m['orca']['max_num_seqs']})",
                "request-level req/s (cap)": f"{m['request-level']['requests_per_s']:.2f} "
                                             f"({m['request-level']['max_num_seqs']})", "ratio": m["ratio"]}
               for m in result.get("matched_latency", [])]
    return {"points": points, "throughput at matched latency": matched}
