"""TCB's section 6 workload through the real engine: fcfs, sjf, edf and das by utility and deadlines.

Requests (TCB ICPP '22, section 6): lengths l in [3, 100] from a normal distribution (mean 20,
variance 20 or 100), Poisson arrivals, batch sizes 16 and 64, several arrival rates. A request of
length l feeds a prompt of max(1, l // 4) tokens and generates the rest (ignore_eos, so every length
is exact); its utility is 1 / l (TCB's v_n). Deadlines (our choice, stated; two models):
"proportional": arrival + slack x l iterations, slack ~ U(1, 3), so a request admitted at once always
makes it and one kept waiting about its own length does not; "uniform": arrival + U(20, 80)
iterations whatever the length (TCB draws deadlines independently of lengths). Time is counted in engine iterations (the scheduler's clock is the
iteration count), so the shared CPU's noise cannot pick the winner; the engine really runs every
batch on a tiny random-weight model. Total utility = sum of 1 / l over requests that finish by their
deadline; every policy drops a request still waiting past its deadline (TCB).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import time

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulingPolicy
from orca_jax.request import SamplingParams

POLICIES = (SchedulingPolicy.FCFS, SchedulingPolicy.SJF, SchedulingPolicy.EDF, SchedulingPolicy.DAS)
VARIANCES = (20.0, 100.0)
BATCH_SIZES = (16, 64)
LOADS = (0.75, 1.5, 3.0)  # arrival rate / the batch's service rate (slots / mean generation length)
DEADLINES = ("proportional", "uniform")


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # iterations
    length: int  # TCB's l: prompt + generated tokens
    budget: float  # iterations from arrival to deadline

    @property
    def num_prompt_tokens(self) -> int:
        return max(1, self.length // 4)

    @property
    def max_tokens(self) -> int:
        return self.length - self.num_prompt_tokens

    @property
    def deadline(self) -> float:
        return self.arrival + self.budget


def make_trace(num_requests: int, variance: float, rate: float, seed: int,
               deadlines: str = "proportional") -> list[TraceRequest]:
    """TCB's workload: clipped-normal lengths, Poisson arrivals at `rate` requests per iteration."""
    if deadlines not in DEADLINES:
        raise ValueError(f"deadlines must be one of {DEADLINES}, got {deadlines!r}")
    rng = random.Random(seed)
    now, trace = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        length = min(100, max(3, round(rng.gauss(20.0, variance ** 0.5))))
        slack, span = rng.uniform(1.0, 3.0), rng.uniform(20.0, 80.0)
        trace.append(TraceRequest(now, length, slack * length if deadlines == "proportional" else span))
    return trace


def service_rate(batch_size: int, variance: float, seed: int = 0) -> float:
    """Requests per iteration the batch finishes when full: slots / mean generated tokens."""
    sample = make_trace(2000, variance, 1.0, seed)
    return batch_size / (sum(r.max_tokens for r in sample) / len(sample))


class IterationClock:
    """The scheduler's clock in a benchmark run: the engine iteration count."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_one(engine, policy: SchedulingPolicy, trace: list[TraceRequest], batch_size: int) -> dict:
    """Drive the trace through `engine` under `policy`; utility, hits and misses."""
    from orca_jax.scheduler import Scheduler

    clock = IterationClock()
    config = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens,
                             policy=policy, async_scheduling=engine.config.async_scheduling)
    engine.replace_scheduler(lambda kv, max_len, stages: Scheduler(config, kv, max_len, stages, clock=clock,
                                                                   token_target=engine.buckets.token_target))
    pending = list(enumerate(trace))
    finished: dict[str, tuple[str, float]] = {}
    wall = time.perf_counter()
    batch_total = iterations = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1].arrival <= clock.now:
            i, r = pending.pop(0)
            engine.add_request([3 + (i + k) % 250 for k in range(r.num_prompt_tokens)],
                               SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                               request_id=str(i), arrival_time=r.arrival, deadline=r.deadline)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.finish_reason, clock.now)
        stats = engine.stats()
        if stats.iterations > iterations:
            iterations, batch_total = stats.iterations, batch_total + stats.last_batch_size
        clock.now += 1.0
    utility = hits = dropped = 0
    for i, r in enumerate(trace):
        reason, at = finished[str(i)]
        dropped += reason == "deadline"
        if reason in ("length", "stop") and at <= r.deadline:
            hits += 1
            utility += 1.0 / r.length
    return {"policy": policy.value, "utility": round(utility, 4), "hit_rate": round(hits / len(trace), 4),
            "dropped": dropped, "iterations": int(clock.now), "wall_seconds": round(time.perf_counter() - wall, 2)}


def run_policies(out_dir: str | None, *, num_requests: int = 160, batch_sizes=BATCH_SIZES,
                 variances=VARIANCES, loads=LOADS, policies=POLICIES, deadlines=DEADLINES, seed: int = 0,
                 model: str = "tiny-llama") -> list[dict]:
    """Every (batch size, variance, load, policy) on one engine; writes JSON, markdown and a plot."""
    from orca_jax.engine import Engine

    engine = Engine(EngineConfig(model=model, cache=CacheConfig(page_size=16, num_pages=1 + 64 * 8),
                                 scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes),
                                                           max_num_batched_tokens=256),
                                 precompile=False, seed=seed))
    rows = []
    for deadline_model, batch_size, variance, load in itertools.product(deadlines, batch_sizes, variances, loads):
        capacity = service_rate(batch_size, variance)
        trace = make_trace(num_requests * batch_size // 16 if batch_size > 16 else num_requests,
                           variance, load * capacity, seed, deadline_model)
        for policy in policies:
            row = {"deadlines": deadline_model, "batch_size": batch_size, "variance": variance, "load": load,
                   "rate_per_iteration": round(load * capacity, 3), "num_requests": len(trace),
                   "max_utility": round(sum(1.0 / r.length for r in trace), 4),
                   **run_one(engine, policy, trace, batch_size)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if out_dir:
        write_results(rows, out_dir)
    return rows


def write_results(rows: list[dict], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "policies.json"), "w") as f:
        json.dump({"device": "CPU (2 shared cores), tiny-llama (random weights, fp32)",
                   "workload": __doc__, "rows": rows}, f, indent=1)
    keys = sorted({(r["deadlines"], r["batch_size"], r["variance"], r["load"]) for r in rows})
    names = [p.value for p in POLICIES if any(r["policy"] == p.value for r in rows)]
    lines = ["| deadlines | batch | variance | load | rate/iter | " + " | ".join(f"{n} utility (hit %)" for n in names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for key in keys:
        cell = {r["policy"]: r for r in rows if (r["deadlines"], r["batch_size"], r["variance"], r["load"]) == key}
        any_row = next(iter(cell.values()))
        best = max(cell.values(), key=lambda r: r["utility"])["policy"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {key[3]:g} | {any_row['rate_per_iteration']} | " + " | ".join(
            (f"**{cell[n]['utility']:.3f}** ({100 * cell[n]['hit_rate']:.0f})" if n == best else
             f"{cell[n]['utility']:.3f} ({100 * cell[n]['hit_rate']:.0f})") for n in names) + " |")
    with open(os.path.join(out_dir, "policies.md"), "w") as f:
        f.write("# Scheduling policies on TCB's workload (CPU, tiny-llama, time in iterations)\n\n"
                + "\n".join(lines) + "\n")
    _plot(rows, keys, names, os.path.join(out_dir, "policies.png"))


def _plot(rows: list[dict], keys, names, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({d for d, *_ in keys})
    panels = sorted({(b, v) for _, b, v, _ in keys})
    fig, axes = plt.subplots(len(models), len(panels), figsize=(3.6 * len(panels), 3.0 * len(models)),
                             squeeze=False)
    for row_axes, model in zip(axes, models):
        for ax, (batch_size, variance) in zip(row_axes, panels):
            for name in names:
                points = sorted((r["load"], r["utility"] / r["max_utility"]) for r in rows
                                if (r["deadlines"], r["batch_size"], r["variance"], r["policy"])
                                == (model, batch_size, variance, name))
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
            ax.set_title(f"{model} deadlines, batch {batch_size}, var {variance:g}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
        row_axes[0].set_ylabel("utility / total utility")
    for ax in axes[-1]:
        ax.set_xlabel("load (arrival / service rate)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
