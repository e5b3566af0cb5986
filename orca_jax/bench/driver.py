"""Drive an Engine through a trace (offline or in real time) and measure every request and iteration.

One Engine (one runner: params, KV pool, compiled programs) serves every configuration of a model:
`use_scheduler` swaps in ORCA's scheduler at some max batch size, or the request-level baseline,
while the engine is idle (Engine.replace_scheduler). `Probe` is an engine observer: it records the
host phases the engine times for each iteration and the batch's shape, for the roofline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np

from orca_jax.batch import RaggedBatch
from orca_jax.bench.baseline import RequestLevelScheduler
from orca_jax.bench.traces import Trace
from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import DispatchTiming, Engine
from orca_jax.request import SamplingParams
from orca_jax.scheduler import Scheduler, SchedulerOutput

ORCA, BASELINE = "orca", "baseline"


def build_engine(model: str, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int = 16,
                 kv_gib: float | None = None, num_pages: int | None = None, max_model_len: int | None = None,
                 attention: AttentionBackend = AttentionBackend.AUTO, dtype: str | None = None,
                 loaded=None) -> Engine:
    """An engine whose buckets fit the largest configuration any later use_scheduler asks for."""
    config = EngineConfig(
        model=model, cache=CacheConfig(page_size=page_size, num_pages=num_pages, kv_memory_gib=kv_gib),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        attention=attention, dtype=dtype, max_model_len=max_model_len)
    return Engine(config, loaded)


def use_scheduler(engine: Engine, policy: str, max_num_seqs: int, batches_in_flight: int | None = None):
    """Swap the idle engine's scheduler: ORCA's (Algorithm 1) or the request-level baseline.

    batches_in_flight: ORCA's batches in flight (default the engine's), or the baseline's
    microbatches, FasterTransformer's pipelining (default one per pipeline stage).
    """
    limits = engine.config.scheduler
    if max_num_seqs > limits.max_num_seqs:
        raise ValueError(f"max_num_seqs {max_num_seqs} exceeds the engine's {limits.max_num_seqs}")
    budget = limits.max_num_batched_tokens
    if policy == ORCA:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_waiting=4096,
                                 async_scheduling=engine.config.async_scheduling)

        def factory(kv, max_model_len, num_stages):
            return Scheduler(config, kv, max_model_len, batches_in_flight or num_stages,
                             token_target=engine.buckets.token_target)
    elif policy == BASELINE:
        microbatches = batches_in_flight or engine.config.parallel.num_stages

        def factory(kv, max_model_len, num_stages):
            return RequestLevelScheduler(max_num_seqs, budget, kv, max_model_len,
                                         num_microbatches=microbatches)
    else:
        raise ValueError(f"unknown policy {policy!r}")
    return engine.replace_scheduler(factory)


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

    def on_dispatch(self, batch: RaggedBatch, timing: DispatchTiming) -> None:
        n = batch.num_real_seqs
        q = np.diff(batch.cu_q_lens[:n + 1]).astype(np.int64)
        k = batch.kv_lens[:n].astype(np.int64)
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


@dataclasses.dataclass(slots=True)
class RunResult:
    label: str
    arrival: np.ndarray  # f64[n] seconds from the run's start
    first_token: np.ndarray  # f64[n]
    finish: np.ndarray  # f64[n]
    prompt_len: np.ndarray  # i64[n]
    gen_tokens: np.ndarray  # i64[n] real generated tokens (the trace's max_tokens)
    wall_s: float
    iterations: int
    batch_size_total: int
    host_s: float
    device_wait_s: float
    records: list[IterationRecord]

    def summary(self) -> dict:
        """Throughput and latency statistics (seconds); latency is from arrival to finish."""
        latency = self.finish - self.arrival
        norm = latency / self.gen_tokens
        ttft = self.first_token - self.arrival
        tpot = (self.finish - self.first_token) / np.maximum(self.gen_tokens - 1, 1)
        span = float(self.finish.max() - self.arrival.min())
        pct = lambda x: {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)} | {"mean": float(x.mean())}
        rec = self.records
        n_it = max(self.iterations, 1)
        return {
            "label": self.label, "num_requests": int(len(self.arrival)), "wall_s": self.wall_s,
            "throughput_req_s": len(self.arrival) / span,
            "generated_tokens": int(self.gen_tokens.sum()),
            "throughput_tok_s": float(self.gen_tokens.sum()) / span,
            "median_norm_latency_s": float(np.median(norm)),
            "norm_latency_s": pct(norm), "latency_s": pct(latency), "ttft_s": pct(ttft), "tpot_s": pct(tpot),
            "iterations": self.iterations, "mean_batch_size": self.batch_size_total / n_it,
            "host_s_per_iter": self.host_s / n_it, "device_wait_s_per_iter": self.device_wait_s / n_it,
            # Host work that never waits on the device: all but runner.execute (which may block).
            "host_excl_dispatch_s_per_iter": (self.host_s - sum(r.dispatch_s for r in rec)) / n_it,
            "host_breakdown_s_per_iter": {
                "schedule": sum(r.schedule_s for r in rec) / n_it, "build_batch": sum(r.build_s for r in rec) / n_it,
                "dispatch": sum(r.dispatch_s for r in rec) / n_it, "update": sum(r.update_s for r in rec) / n_it},
            "tokens_fed": sum(r.tokens for r in rec), "padded_tokens_fed": sum(r.padded_tokens for r in rec),
        }


def run_trace(engine: Engine, trace: Trace, label: str, *, realtime: bool = True,
              max_seconds: float | None = None) -> RunResult:
    """Feed the trace to the engine and step it until every request finishes.

    realtime: a request is added once its arrival time has passed (checked before every iteration;
    the loop sleeps only while the engine is idle). Otherwise all requests are added at the start.
    """
    vocab = engine.model_config.vocab_size
    prompts = [trace.prompt_ids(i, vocab) for i in range(len(trace))]
    arrival = np.array([r.arrival for r in trace.requests]) if realtime else np.zeros(len(trace))
    return _drive(engine, label, arrival, prompts, [r.max_tokens for r in trace.requests], max_seconds)


def run_one_at_a_time(engine: Engine, trace: Trace, label: str) -> RunResult:
    """Each request alone, the next one added when the last finished; arrivals are ignored."""
    vocab = engine.model_config.vocab_size
    parts = [_drive(engine, label, np.zeros(1), [trace.prompt_ids(i, vocab)], [r.max_tokens], None)
             for i, r in enumerate(trace.requests)]
    offsets = np.cumsum([0.0] + [p.wall_s for p in parts[:-1]])
    cat = lambda field: np.concatenate([getattr(p, field) + o for p, o in zip(parts, offsets)])
    return RunResult(
        label=label, arrival=cat("arrival"), first_token=cat("first_token"), finish=cat("finish"),
        prompt_len=np.concatenate([p.prompt_len for p in parts]),
        gen_tokens=np.concatenate([p.gen_tokens for p in parts]), wall_s=sum(p.wall_s for p in parts),
        iterations=sum(p.iterations for p in parts), batch_size_total=sum(p.batch_size_total for p in parts),
        host_s=sum(p.host_s for p in parts), device_wait_s=sum(p.device_wait_s for p in parts),
        records=[rec for p in parts for rec in p.records])


def _drive(engine: Engine, label: str, arrival: np.ndarray, prompts: list[list[int]], max_tokens: list[int],
           max_seconds: float | None) -> RunResult:
    n = len(prompts)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    stats0 = engine.stats()
    with Probe(engine) as probe:
        start = time.perf_counter()
        added = 0
        try:
            while added < n or engine.has_unfinished():
                now = time.perf_counter() - start
                while added < n and arrival[added] <= now:
                    engine.add_request(prompts[added], SamplingParams(max_tokens=max_tokens[added],
                                                                      ignore_eos=True), request_id=str(added))
                    added += 1
                if not engine.has_unfinished():
                    time.sleep(max(0.0, arrival[added] - (time.perf_counter() - start)))
                    continue
                outputs = engine.step()
                now = time.perf_counter() - start
                for out in outputs:
                    i = int(out.request_id)
                    if np.isnan(first[i]) and out.new_token_ids:
                        first[i] = now
                    if out.finished:
                        finish[i] = now
                if max_seconds is not None and now > max_seconds:
                    raise TimeoutError(f"{label}: still running after {max_seconds:.0f}s")
        except BaseException:
            _abort_all(engine, added)
            raise
        wall = time.perf_counter() - start
    stats1 = engine.stats()
    return RunResult(
        label=label, arrival=arrival, first_token=first, finish=finish,
        prompt_len=np.array([len(p) for p in prompts]), gen_tokens=np.array(max_tokens), wall_s=wall,
        iterations=stats1.iterations - stats0.iterations,
        batch_size_total=stats1.batch_size_total - stats0.batch_size_total,
        host_s=stats1.host_seconds_total - stats0.host_seconds_total,
        device_wait_s=stats1.device_wait_seconds_total - stats0.device_wait_seconds_total,
        records=probe.records)


def _abort_all(engine: Engine, count: int) -> None:
    """Leave the engine idle after a failed run, so the next run can swap schedulers."""
    for i in range(count):
        engine.abort(str(i))
    while engine.has_unfinished():
        engine.step()
