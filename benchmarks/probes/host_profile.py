"""Host cost of one engine iteration, by phase, at 1, 32 and 256 running sequences (decode steady state)
and one mixed prefill + decode case (issue 37: small models are host-bound).

Each case adds its requests to a real Engine (random weights, EOS ignored, greedy), steps until every
one decodes, then times `--iterations` steps. Per step (µs, medians over steps):
- schedule, build, dispatch, update: the engine's own split (EngineObserver; dispatch is runner.execute:
  packing, host-to-device copies and program launches);
- wait: blocked on the device's tokens (EngineStats.device_wait_seconds_total);
- output: the rest of step() (logprobs lists, non-finite check, RequestOutputs, detokenizer);
- step: the whole of step(); host = step - wait;
- launch: the runner's calls themselves (execute, or forward and sample), on whichever thread made them:
  with the dispatch thread (engine/dispatcher.py) `dispatch` is only the submission, and the launches
  run beside the engine thread's phases (summed per step, from the step's start to the next's).
Then, on the plans of the timed steps, replayed with no device (`parts`, µs per call): build_batch's
forward arrays apart from the sampling inputs (SamplingBatcher.rows), pack_forward_inputs, and the
RequestOutputs of a batch (output_processor.request_output per row). `--cprofile N` adds each case's
top N functions by own time (cProfile inflates Python time: read it for shares, not totals).

    PYTHONPATH=. python benchmarks/probes/host_profile.py --model tiny-llama --no-async \\
        --json benchmarks/results/cpu/probes/host_profile.json
    PYTHONPATH=. python benchmarks/probes/host_profile.py --model llama-1b --precompile --json host_profile_llama1b.json

On a CPU the device is the same two cores: run with --no-async there, so the device computes only while
the host waits (`wait`); even so `dispatch` includes the part of the device's work XLA runs inline.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import statistics
import threading
import time

import numpy as np

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.engine.output_processor import request_output
from orca_jax.sample.batcher import SamplingBatcher
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.input_batch import build_batch, pack_forward_inputs

# ours: schedule + build + update + output, the Python loop apart from the launches and the device;
# gc: the cyclic garbage collector's pauses inside the step (already counted in the phase they hit)
PHASES = ("schedule", "build", "dispatch", "update", "output", "ours", "gc", "wait", "host", "step", "launch")


class GCPauses:
    """Seconds the cyclic garbage collector ran since the last take() (gc.callbacks)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class LaunchTimer:
    """Seconds spent inside the runner's dispatching calls, whichever thread makes them."""

    def __init__(self, runner):
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._depth = threading.local()  # execute calls sample itself: only the outermost call is timed
        self._runner = runner
        self._originals = {name: getattr(runner, name) for name in ("execute", "forward", "sample")}
        for name, original in self._originals.items():
            setattr(runner, name, self._timed(original))

    def _timed(self, call):
        depth = self._depth

        def timed(*args):
            if getattr(depth, "n", 0):
                return call(*args)
            depth.n, start = 1, time.perf_counter()
            try:
                return call(*args)
            finally:
                depth.n = 0
                with self._lock:
                    self.seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds

    def remove(self) -> None:
        for name in self._originals:
            delattr(self._runner, name)  # the class's methods again


class Split:
    """An engine observer summing the engine's own host split per step."""

    def __init__(self):
        self.plans, self.batches = [], []
        self.schedule = self.build = self.dispatch = self.update = 0.0

    def on_dispatch(self, batch, timing):
        self.schedule += timing.schedule_s
        self.build += timing.build_s
        self.dispatch += timing.dispatch_s
        self.batches.append(batch)

    def on_update(self, output, seconds):
        self.update += seconds
        self.plans.append(output)

    def take(self) -> dict:
        out = {"schedule": self.schedule, "build": self.build, "dispatch": self.dispatch, "update": self.update}
        self.schedule = self.build = self.dispatch = self.update = 0.0
        return out


def make_engine(args) -> Engine:
    max_seqs = max(args.seqs)
    config = EngineConfig(
        model=args.model, max_model_len=args.max_model_len, precompile=args.precompile, seed=0,
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_pages,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  async_scheduling=not args.no_async))
    return Engine(config)


def prompt(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def run_case(engine: Engine, name: str, num_seqs: int, args, mixed: bool) -> dict:
    """Time args.iterations steps with num_seqs requests decoding (mixed: and a new prompt every
    args.mixed_every steps, which leaves after args.mixed_tokens outputs)."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    long = SamplingParams(max_tokens=args.warmup + args.iterations + 16, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(prompt(rng, args.prompt_len, vocab), long) for _ in range(num_seqs)]
    split = Split()
    engine.add_observer(split)
    short = SamplingParams(max_tokens=args.mixed_tokens, ignore_eos=True, temperature=0.0)
    # Warm up past every prompt (the decode cases' steady state), then args.warmup more steps.
    warmup = args.warmup + -(-num_seqs * args.prompt_len // args.max_num_batched_tokens)
    rows, profiler, pauses = [], cProfile.Profile() if args.cprofile else None, GCPauses()
    launches = LaunchTimer(engine.runner)
    for i in range(warmup + args.iterations):
        timed = i >= warmup
        if mixed and i % args.mixed_every == 0:
            engine.add_request(prompt(rng, args.mixed_prompt_len, vocab), short)
        wait_before = engine.stats().device_wait_seconds_total
        split.take()
        pauses.take()
        launches.take()
        if timed and profiler:
            profiler.enable()
        start = time.perf_counter()
        outputs = engine.step()
        step = time.perf_counter() - start
        if timed and profiler:
            profiler.disable()
        if not outputs and not engine.has_unfinished():
            raise RuntimeError(f"{name}: the engine ran dry; raise max_tokens")
        row = split.take() | {"wait": engine.stats().device_wait_seconds_total - wait_before, "step": step,
                              "gc": pauses.take(), "launch": launches.take()}
        row["host"] = step - row["wait"]
        row["ours"] = step - row["wait"] - row["dispatch"]
        row["output"] = step - sum(row[k] for k in ("schedule", "build", "dispatch", "update", "wait"))
        if timed:
            rows.append(row)
        if i == warmup - 1:
            split.plans, split.batches = [], []
    engine.remove_observer(split)
    gc.callbacks.remove(pauses)
    launches.remove()
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    batches = split.batches[:len(rows)]
    result = {"case": name, "num_seqs": num_seqs,
              "mean_batch": statistics.mean(b.num_real_seqs for b in batches),
              "mean_tokens": statistics.mean(b.num_real_tokens for b in batches),
              "us": {k: 1e6 * statistics.median(r[k] for r in rows) for k in PHASES},
              "mean_us": {k: 1e6 * statistics.mean(r[k] for r in rows) for k in PHASES},
              "parts_us": replay(engine, split.plans, args)}
    if profiler:
        result["cprofile"] = top_functions(profiler, args.cprofile, len(rows))
    return result


def replay(engine: Engine, plans, args) -> dict:
    """µs per call of the host pieces, replayed on the timed steps' plans (no device)."""
    sampling = SamplingBatcher(engine.runner.sampler.num_penalty_slots, engine.runner.config.vocab_size,
                               engine.config.sampling.logit_table_width, engine.config.sampling.max_logprobs)
    times = {"build_batch": [], "sampling_rows": [], "pack_forward_inputs": [], "request_outputs": []}
    for plan in plans[:args.replays]:
        for _ in range(3):
            t0 = time.perf_counter()
            batch = build_batch(plan, engine.buckets, sampling)
            t1 = time.perf_counter()
            sampling.rows(plan.scheduled, batch.kv_lens.shape[0])
            t2 = time.perf_counter()
            pack_forward_inputs(batch)
            t3 = time.perf_counter()
            for item in plan.scheduled:
                request_output(item.request, 1)
            t4 = time.perf_counter()
            for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(seconds)
    out = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    out["build_forward_arrays"] = out["build_batch"] - out["sampling_rows"]
    return out


def top_functions(profiler: cProfile.Profile, n: int, steps: int) -> list[dict]:
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{file.rsplit('/', 2)[-2:]}:{line}:{fn}" if "/" in file else f"{file}:{fn}",
             "calls_per_step": calls / steps, "own_us_per_step": 1e6 * own / steps,
             "cum_us_per_step": 1e6 * cum / steps}
            for (file, line, fn), (_, calls, own, cum, _) in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 256])
    parser.add_argument("--mixed-seqs", type=int, default=32, help="decoding sequences of the mixed case (0: none)")
    parser.add_argument("--mixed-every", type=int, default=4, help="a new prompt every this many steps")
    parser.add_argument("--mixed-prompt-len", type=int, default=96)
    parser.add_argument("--mixed-tokens", type=int, default=8, help="outputs of each mixed-in prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--replays", type=int, default=30, help="plans replayed for `parts_us`")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None, help="None: sized from device memory")
    parser.add_argument("--no-async", action="store_true",
                        help="async scheduling off: on a CPU, keeps the device's work out of the host phases")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--precompile", action="store_true", help="compile every bucket first (GPU runs)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.collect(); gc.freeze() once the engine is built (what a process owning one could do)")
    parser.add_argument("--cprofile", type=int, default=0, help="top N functions per case by own time")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.num_pages is None and args.model.startswith("tiny"):
        args.num_pages = 1 + max(args.seqs + [args.mixed_seqs + 8]) * -(-args.max_model_len // args.page_size)
    engine = make_engine(args)
    if args.gc_freeze:  # the engine's long-lived objects out of the collector's scans (vLLM's engine core does this)
        gc.collect()
        gc.freeze()
    cases = [(f"decode-{n}", n, False) for n in args.seqs]
    if args.mixed_seqs:
        cases.append((f"mixed-{args.mixed_seqs}", args.mixed_seqs, True))
    results = []
    print(f"{'case':>12} {'batch':>6} {'tok':>6} " + " ".join(f"{p:>9}" for p in PHASES) + "   (µs per step, median)")
    for name, n, mixed in cases:
        r = run_case(engine, name, n, args, mixed)
        results.append(r)
        print(f"{name:>12} {r['mean_batch']:6.1f} {r['mean_tokens']:6.1f} "
              + " ".join(f"{r['us'][p]:9.0f}" for p in PHASES))
        print(" " * 12 + "  parts (µs/call): " + ", ".join(f"{k} {v:.0f}" for k, v in r["parts_us"].items()))
    if args.json:
        meta = {"model": args.model, "machine": platform.node(), "processor": platform.processor(),
                "python": platform.python_version(), "args": vars(args),
                "device": str(engine.runner.device), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
