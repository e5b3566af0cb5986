"""Drive an Engine through a trace and measure every request and iteration.

One Engine (one runner: params, KV pool, compiled programs) serves every configuration of a model:
`use_scheduler` swaps in ORCA's scheduler (any batch cap, policy, async scheduling on or off, batches
in flight) or the request-level baseline while the engine is idle (Engine.replace_scheduler), so
configurations differ only in scheduling. `Probe` is an engine observer: the host phases the engine
times for each iteration and the batch's shape, for the roofline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import time
from typing import Callable

import numpy as np

from orca_jax.bench.baseline import RequestLevelScheduler
from orca_jax.bench.datasets import Trace
from orca_jax.config import SchedulingPolicy
from orca_jax.core.sched.output import SchedulerOutput
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.engine import Engine
from orca_jax.engine.core import DispatchTiming
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.input_batch import RaggedBatch


class SchedulerKind(enum.Enum):
    ORCA = "orca"  # iteration-level scheduling (Algorithm 1)
    REQUEST_LEVEL = "request-level"  # the paper's baseline: FasterTransformer's batching (baseline.py)


class IterationClock:
    """A scheduler clock that counts engine iterations (TCB's workload: time in iterations)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler_factory(engine: Engine, kind: SchedulerKind, *, max_num_seqs: int, async_scheduling: bool = True,
                      max_in_flight: int | None = None, policy: SchedulingPolicy = SchedulingPolicy.FCFS,
                      clock=time.monotonic):
    """A factory (kv, max_model_len, max_in_flight) -> scheduler for one configuration on `engine`:
    the engine's token budget and KV pool, this batch cap, policy and clock. max_in_flight None: as
    EngineConfig.effective_max_in_flight; the baseline's microbatches default to one per stage."""
    limits = engine.config.scheduler
    if max_num_seqs > limits.max_num_seqs:
        raise ValueError(f"max_num_seqs {max_num_seqs} exceeds the engine's {limits.max_num_seqs}")
    stages = engine.config.parallel.num_stages
    if kind is SchedulerKind.REQUEST_LEVEL:
        def request_level(kv, max_model_len, _in_flight):
            return RequestLevelScheduler(max_num_seqs, limits.max_num_batched_tokens, kv, max_model_len,
                                         clock=clock, num_microbatches=max_in_flight or stages)
        return request_level
    config = dataclasses.replace(limits, max_num_seqs=max_num_seqs, policy=policy, async_scheduling=async_scheduling)
    # The engine's own rule for the batches in flight (one per stage, at least two with async scheduling).
    in_flight = dataclasses.replace(engine.config, scheduler=config, max_in_flight=max_in_flight).effective_max_in_flight

    def orca(kv, max_model_len, _in_flight):
        return Scheduler(config, kv, max_model_len, in_flight, clock=clock, token_target=engine.buckets.token_target,
                         pipeline_stages=stages)
    return orca


def use_scheduler(engine: Engine, kind: SchedulerKind, **options):
    """Swap the idle engine's scheduler for one configuration (scheduler_factory's options)."""
    return engine.replace_scheduler(scheduler_factory(engine, kind, **options))


@dataclasses.dataclass(slots=True)
class IterationRecord:
    """One iteration's shape (from the ragged batch) and host phases (seconds)."""

    tokens: int  # real tokens fed
    padded_tokens: int  # T of the compiled bucket
    seqs: int
    kv_tokens: int  # sum of kv_lens: K/V tokens attention reads
    attn_pairs: int  # causal (query, key) pairs: sum over queries of their context length
    schedule_s: float = 0.0
    build_s: float = 0.0
    dispatch_s: float = 0.0
    update_s: float = 0.0


class Probe(contextlib.AbstractContextManager):
    """Records each dispatched batch's shape and the host phases the engine timed (an EngineObserver)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.records: list[IterationRecord] = []
        self.decode_batch: RaggedBatch | None = None  # the last of the widest batches of one token per request

    def on_dispatch(self, batch: RaggedBatch, timing: DispatchTiming) -> None:
        n = batch.num_real_seqs
        q = np.diff(batch.cu_q_lens[:n + 1]).astype(np.int64)
        k = batch.kv_lens[:n].astype(np.int64)
        if batch.num_real_tokens == n and n >= (self.decode_batch.num_real_seqs if self.decode_batch else 1):
            self.decode_batch = batch
        self.records.append(IterationRecord(
            tokens=batch.num_real_tokens, padded_tokens=int(batch.token_ids.shape[0]), seqs=n,
            kv_tokens=int(k.sum()), attn_pairs=int((q * k - q * (q - 1) // 2).sum()),
            schedule_s=timing.schedule_s, build_s=timing.build_s, dispatch_s=timing.dispatch_s))

    def on_update(self, output: SchedulerOutput, seconds: float) -> None:
        if self.records:
            self.records[-1].update_s += seconds

    def __enter__(self):
        self.engine.add_observer(self)
        return self

    def __exit__(self, *exc):
        self.engine.remove_observer(self)
        return False


def _percentiles(x: np.ndarray) -> dict:
    x = x[~np.isnan(x)]
    if not x.size:
        return {}
    return {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)} | {"mean": float(x.mean())}


@dataclasses.dataclass(slots=True)
class TraceRun:
    """What one run of a trace through the engine measured; times on the trace's clock."""

    trace: Trace
    arrival: np.ndarray  # f64[n] after the run's start
    first_token: np.ndarray  # f64[n] (nan: none)
    finish: np.ndarray  # f64[n]
    finish_reason: list[str | None]
    output_tokens: np.ndarray  # i64[n] tokens each request got
    step_end: np.ndarray  # f64[iterations] when each engine.step() returned (wall seconds after the start)
    wall_s: float
    stats: dict  # engine counters over the run
    records: list[IterationRecord]
    decode_batch: RaggedBatch | None = None  # Probe.decode_batch

    def deadline_met(self) -> np.ndarray:
        """bool[n]: finished by its deadline (TCB's hits; requests without one never count)."""
        budget = np.array([np.inf if r.deadline is None else r.deadline for r in self.trace.requests])
        done = np.array([reason in ("length", "stop") for reason in self.finish_reason])
        return done & (self.finish <= self.arrival + budget)

    def summary(self) -> dict:
        """Throughput, latency statistics (per second, or per iteration for a trace timed in iterations)
        and the host's time, split."""
        # Tokens a request asked for: the request-level baseline also computes padding tokens past them.
        wanted = np.array([r.max_tokens for r in self.trace.requests])
        n, generated = len(self.arrival), int(np.minimum(self.output_tokens, wanted).sum())
        span = float(np.nanmax(self.finish) - self.arrival.min()) if n else 0.0
        latency = self.finish - self.arrival
        iterations = max(self.stats["iterations"], 1)
        split = {f"{name}_s": sum(getattr(r, f"{name}_s") for r in self.records)
                 for name in ("schedule", "build", "dispatch", "update")}
        fed = sum(r.tokens for r in self.records)
        unit = "s" if self.trace.time_unit == "s" else "iteration"  # of every rate and latency below
        out = {"num_requests": n, "wall_s": self.wall_s, "generated_tokens": generated,
               f"tokens_per_{unit}": generated / span if span > 0 else 0.0,
               f"requests_per_{unit}": n / span if span > 0 else 0.0,
               f"median_norm_latency_{unit}": float(np.nanmedian(latency / np.maximum(self.output_tokens, 1))),
               f"latency_{unit}": _percentiles(latency), f"ttft_{unit}": _percentiles(self.first_token - self.arrival),
               f"tpot_{unit}": _percentiles((self.finish - self.first_token) / np.maximum(self.output_tokens - 1, 1)),
               "ms_per_iteration": 1e3 * self.wall_s / iterations,
               **self.stats, "host_split": split | {"rest_s": self.stats["host_s"] - sum(split.values())},
               "tokens_fed": fed, "padded_tokens_fed": sum(r.padded_tokens for r in self.records),
               "fed_over_real": sum(r.padded_tokens for r in self.records) / max(fed, 1)}
        if any(r.deadline is not None for r in self.trace.requests):
            met = self.deadline_met()
            lengths = np.array([r.prompt_len + r.max_tokens for r in self.trace.requests])
            out |= {"utility": float((1.0 / lengths)[met].sum()), "max_utility": float((1.0 / lengths).sum()),
                    "hit_rate": float(met.mean()), "dropped": sum(r == "deadline" for r in self.finish_reason)}
        return out


def run_trace(engine: Engine, trace: Trace, *, realtime: bool = True, clock: IterationClock | None = None,
              max_seconds: float | None = None, ignore_eos: bool = True,
              sampling: Callable[[int], SamplingParams] | None = None) -> TraceRun:
    """Feed the trace to the engine and step it until every request finishes.

    `sampling(max_tokens)`: each request's SamplingParams (None: greedy, EOS ignored unless told).

    A request is added once its arrival has passed (checked before every iteration; the loop sleeps only
    while the engine is idle), or all at once unless `realtime`. A trace timed in iterations needs the
    IterationClock the engine's scheduler reads (use_scheduler(clock=...)); it advances once a step.
    Every run starts with an empty prefix cache: a trace's prompts are the same on every run, and an
    earlier run's pages would otherwise be hits.
    """
    if (trace.time_unit == "iteration") != (clock is not None):
        raise ValueError("a trace timed in iterations needs the scheduler's IterationClock, and only it")
    vocab = engine.model_config.vocab_size
    n = len(trace)
    arrival = np.array([r.arrival for r in trace.requests]) if realtime else np.zeros(n)
    # Plain lists in the loop: its per-token bookkeeping must cost the host as little as can be.
    first, finish, reasons, tokens = [math.nan] * n, [math.nan] * n, [None] * n, [0] * n
    steps: list[float] = []
    engine.reset_prefix_cache()
    before = engine.stats()
    with Probe(engine) as probe:
        start = time.perf_counter()
        now = (lambda: clock.now) if clock is not None else (lambda: time.perf_counter() - start)
        added = 0
        try:
            while added < n or engine.has_unfinished():
                while added < n and arrival[added] <= now():
                    spec = trace.requests[added]
                    deadline = None if spec.deadline is None or clock is None else spec.arrival + spec.deadline
                    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=ignore_eos) if sampling is None \
                        else sampling(spec.max_tokens)
                    engine.add_request(trace.prompt_ids(added, vocab), params,
                                       request_id=str(added), deadline=deadline,
                                       arrival_time=spec.arrival if clock is not None else None)
                    added += 1
                if not engine.has_unfinished() and clock is None:
                    time.sleep(max(0.0, arrival[added] - now()))
                    continue
                outputs = engine.step()
                steps.append(time.perf_counter() - start)
                at = clock.now if clock is not None else steps[-1]
                for out in outputs:
                    i = int(out.request_id)
                    tokens[i] += len(out.new_token_ids)
                    if first[i] != first[i] and out.new_token_ids:  # still nan
                        first[i] = at
                    if out.finished:
                        finish[i], reasons[i] = at, out.finish_reason
                if clock is not None:
                    clock.now += 1.0
                if max_seconds is not None and steps[-1] > max_seconds:
                    raise TimeoutError(f"{trace.label}: still running after {max_seconds:.0f} s")
        except BaseException:
            _abort_all(engine, added)
            raise
        wall = time.perf_counter() - start
    after = engine.stats()
    stats = {"iterations": after.iterations - before.iterations,
             "mean_batch_size": (after.batch_size_total - before.batch_size_total)
             / max(after.iterations - before.iterations, 1),
             "mean_in_flight": (after.in_flight_total - before.in_flight_total)
             / max(after.iterations - before.iterations, 1),
             "host_s": after.host_seconds_total - before.host_seconds_total,
             "device_wait_s": after.device_wait_seconds_total - before.device_wait_seconds_total,
             "preemptions": after.num_preemptions - before.num_preemptions,
             "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,

             # structured outputs: host seconds filling masks, batches masked, batches whose sampling waited
             "mask_s": after.structured_mask_seconds_total - before.structured_mask_seconds_total,
             "masked_batches": after.structured_masked_batches - before.structured_masked_batches,
             "masked_rows": after.structured_masked_rows - before.structured_masked_rows,
             "deferred_batches": after.structured_deferred_batches - before.structured_deferred_batches}
    return TraceRun(trace, arrival, np.array(first), np.array(finish), reasons, np.array(tokens, np.int64),
                    np.array(steps), wall, stats, probe.records, probe.decode_batch)


def _abort_all(engine: Engine, count: int) -> None:
    """Leave the engine idle after a failed run, so the next run can swap schedulers."""
    for i in range(count):
        engine.abort(str(i))
    while engine.has_unfinished():
        engine.step()
