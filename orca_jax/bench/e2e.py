"""End to end (ORCA Fig. 10): median normalized latency vs throughput over a sweep of arrival rates.

Each point replays a short Poisson trace (same seed, so the same requests at every rate) in real time
through one configuration: ORCA's scheduler at some max batch size, or the request-level baseline.
A configuration stops at the first rate where it is clearly saturated (it completed requests at less
than `keep_up` x the arrival rate, or its median normalized latency passed `saturated_factor` x its
first point's), since higher rates only queue longer.
"""

from __future__ import annotations

import numpy as np

from orca_jax.bench import driver, roofline
from orca_jax.bench.traces import LengthSpec, TraceKind, make_trace
from orca_jax.engine import Engine


def point_size(rate: float, seconds: float, lo: int, hi: int) -> int:
    """Requests in one point: about `seconds` of arrivals, clamped to [lo, hi]."""
    return int(min(hi, max(lo, round(rate * seconds))))


def sweep(engine: Engine, configs, rates, costs: roofline.ModelCosts, peaks: roofline.Peaks, *, seed: int = 0,
          point_seconds: float = 6.0, min_requests: int = 48, max_requests: int = 160,
          saturated_factor: float = 8.0, keep_up: float = 0.75, max_point_s: float = 60.0, deadline=None, on_point=None,
          lengths: LengthSpec = LengthSpec()) -> list[dict]:
    """configs: [(policy, max_num_seqs)]; rates: requests/s ascending. One dict per point."""
    points = []
    for policy, bs in configs:
        first_latency = None
        for rate in rates:
            if deadline is not None and deadline.expired():
                return points
            driver.use_scheduler(engine, policy, bs)
            n = point_size(rate, point_seconds, min_requests, max_requests)
            trace = make_trace(TraceKind.UNIFORM, n, rate, seed, lengths)
            label = f"{policy}-bs{bs}-rate{rate:.3g}"
            try:
                run = driver.run_trace(engine, trace, label, realtime=True, max_seconds=max_point_s)
            except TimeoutError as err:
                points.append({"policy": policy, "max_num_seqs": bs, "rate": rate, "error": str(err)})
                break
            point = run.summary() | {"policy": policy, "max_num_seqs": bs, "rate": rate,
                                     "trace": trace.describe(),
                                     "roofline": roofline.run_bound(costs, peaks, run.records, run.wall_s)}
            points.append(point)
            if on_point is not None:
                on_point(points)
            latency = point["median_norm_latency_s"]
            first_latency = latency if first_latency is None else first_latency
            # Saturated: it finished requests clearly slower than they arrived, or latency blew up.
            if point["throughput_req_s"] < keep_up * rate or latency > saturated_factor * first_latency:
                break
    return points


def throughput_at_latency(points: list[dict], target: float) -> float:
    """Highest throughput (req/s) at which median normalized latency stays <= target, interpolating
    linearly between the last point under the target and the next one over it; 0 if none is under."""
    ok = [p for p in points if "error" not in p]
    ok.sort(key=lambda p: p["rate"])
    best = 0.0
    for lo, hi in zip([None] + ok[:-1], ok):
        if hi["median_norm_latency_s"] <= target:
            best = max(best, hi["throughput_req_s"])
        elif lo is not None and lo["median_norm_latency_s"] <= target:
            frac = (target - lo["median_norm_latency_s"]) / (hi["median_norm_latency_s"] - lo["median_norm_latency_s"])
            best = max(best, lo["throughput_req_s"] + frac * (hi["throughput_req_s"] - lo["throughput_req_s"]))
    return best


def compare_at_matched_latency(points: list[dict], multiples=(2.0, 4.0, 8.0)) -> list[dict]:
    """Best throughput of each policy (over its batch sizes) under latency targets set as multiples of
    ORCA's lowest median normalized latency; the ratio is ORCA's over the baseline's."""
    ok = [p for p in points if "error" not in p]
    orca = [p for p in ok if p["policy"] == driver.ORCA]
    base = [p for p in ok if p["policy"] == driver.BASELINE]
    if not orca or not base:
        return []
    floor = min(p["median_norm_latency_s"] for p in orca)
    rows = []
    for m in multiples:
        target = m * floor
        best = {}
        for name, group in ((driver.ORCA, orca), (driver.BASELINE, base)):
            per_bs = {bs: throughput_at_latency([p for p in group if p["max_num_seqs"] == bs], target)
                      for bs in sorted({p["max_num_seqs"] for p in group})}
            best[name] = (max(per_bs.values()), max(per_bs, key=per_bs.get), per_bs)
        o, b = best[driver.ORCA][0], best[driver.BASELINE][0]
        rows.append({"latency_target_s_per_token": target, "multiple_of_orca_floor": m,
                     "orca_req_s": o, "orca_best_bs": best[driver.ORCA][1],
                     "baseline_req_s": b, "baseline_best_bs": best[driver.BASELINE][1],
                     "ratio": (o / b) if b > 0 else (float("inf") if o > 0 else None),
                     "per_batch_size": {k: v[2] for k, v in best.items()}})
    return rows


def rates_from_capacity(capacity_req_s: float, fractions=(0.15, 0.35, 0.6, 0.85, 1.1)) -> list[float]:
    """Sweep rates as fractions of a measured offline capacity."""
    return [float(np.round(capacity_req_s * f, 3)) for f in fractions]
