"""Probe: where a decode iteration's time goes at a (tensor, pipeline) layout, host against device.

For one layout, on random bf16 weights: B requests decode together (context about --input-len); then
- ms per engine iteration (median of --steps), with the engine's own split of each iteration into
  schedule / build / dispatch (DispatchTiming) and the wait for the device;
- the last decode batch replayed back to back: how long the host takes to dispatch one iteration
  (the calls return before the device is done) and how long the device takes per iteration;
- the same replay split into its programs: the forward of every stage, and sampling;
- a jax profiler trace of --profile-steps iterations (device and host timelines), for
  mesh_trace_summary.py.

    python benchmarks/probes/mesh_profile.py --model llama-8b -tp 2 -pp 1 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import jax

from orca_jax.bench.harness import random_model
from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams


class Timings:
    """An engine observer keeping each dispatch's host split."""

    def __init__(self):
        self.dispatch = []

    def on_dispatch(self, batch, timing) -> None:
        self.dispatch.append((timing.schedule_s, timing.build_s, timing.dispatch_s))

    def on_update(self, output, seconds: float) -> None:
        pass


def replay_ms(fn, repeats: int) -> tuple[float, float]:
    """(host ms per call until every call has returned, wall ms per call once the device is done).
    The device runs the calls in order, so the last call's result being ready means all are."""
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    dispatched = time.perf_counter()
    jax.block_until_ready(out)
    done = time.perf_counter()
    return 1e3 * (dispatched - start) / repeats, 1e3 * (done - start) / repeats


class ForwardReleased:
    """Forwards whose logits buffer goes back to the runner (as sampling would give it back), so the
    replay writes the same buffer each call, as serving does. A call gives the previous call's logits
    back only then: the latest stays live for the caller to wait on."""

    def __init__(self, runner, batch):
        self.runner, self.batch, self.last = runner, batch, None

    def __call__(self):
        if self.last is not None:
            self.runner.release_logits(self.last)
        self.last = self.runner.forward(self.batch)
        return self.last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("-tp", type=int, default=1)
    parser.add_argument("-pp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--async-scheduling", default="on")
    parser.add_argument("--quantization", default=None, help="fp8: FP8 projection weights")
    parser.add_argument("--attention-backend", default="auto", help="auto, pallas, pallas-attention, jnp")
    parser.add_argument("--dispatch-thread", default="on", help="on: the engine launches on a thread of its own")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.model}{'_' + args.quantization if args.quantization else ''}_tp{args.tp}_pp{args.pp}_b{args.batch_size}"
    name += "" if args.attention_backend == "auto" else f"_{args.attention_backend}"
    name += "" if args.dispatch_thread == "on" else "_inline"

    start = time.perf_counter()
    config = EngineConfig(model=args.model, dtype="bfloat16", precompile=False, compilation_cache_dir=None,
                          quantization=args.quantization, attention=AttentionBackend(args.attention_backend),
                          cache=CacheConfig(enable_prefix_caching=False, kv_memory_gib=4.0),
                          scheduler=SchedulerConfig(max_num_seqs=max(8, args.batch_size), max_num_batched_tokens=1024,
                                                    async_scheduling=args.async_scheduling == "on"),
                          parallel=ParallelConfig(num_stages=args.pp, tensor_parallel=args.tp),
                          dispatch_thread=args.dispatch_thread == "on")
    engine = Engine(config, random_model(args.model))
    built_s = time.perf_counter() - start
    steps = args.steps + args.profile_steps + 8
    ids = [engine.add_request([5 + i] * args.input_len, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
           for i in range(args.batch_size)]
    seen: set[str] = set()
    while len(seen) < args.batch_size:
        seen.update(out.request_id for out in engine.step())
    for _ in range(4):  # every decode program compiled, the pipeline full
        engine.step()

    timings = Timings()
    engine.add_observer(timings)
    before = engine.stats()
    wall = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    after = engine.stats()
    engine.remove_observer(timings)
    iterations = after.iterations - before.iterations
    row = {
        "layout": {"tp": args.tp, "pp": args.pp}, "batch_size": args.batch_size, "input_len": args.input_len,
        "device": jax.devices()[0].device_kind, "num_devices": engine.runner.num_devices, "build_s": built_s,
        "ms_per_step": 1e3 * statistics.median(wall), "ms_per_step_all": [1e3 * w for w in wall],
        "host_ms_per_iteration": 1e3 * (after.host_seconds_total - before.host_seconds_total) / iterations,
        "device_wait_ms_per_iteration": 1e3 * (after.device_wait_seconds_total - before.device_wait_seconds_total)
        / iterations,
        "schedule_ms": 1e3 * statistics.median(t[0] for t in timings.dispatch),
        "build_ms": 1e3 * statistics.median(t[1] for t in timings.dispatch),
        "dispatch_ms": 1e3 * statistics.median(t[2] for t in timings.dispatch),
    }

    # The last decode batch replayed back to back, whole and by program.
    with_probe = []
    engine.add_observer(type("Last", (), {"on_dispatch": lambda self, b, t: with_probe.append(b),
                                          "on_update": lambda self, o, s: None})())
    engine.step()
    engine.drain()  # the replays below call the runner from this thread
    batch = with_probe[-1]
    runner = engine.runner
    row["replay_execute_ms"] = replay_ms(lambda: runner.execute(batch), 30)
    forward = ForwardReleased(runner, batch)
    row["replay_forward_ms"] = replay_ms(forward, 30)
    logits = forward.last
    row["replay_sample_ms"] = replay_ms(lambda: runner.sample(logits, batch), 30)
    print(json.dumps({k: v for k, v in row.items() if k != "ms_per_step_all"}), flush=True)

    runner.release_logits(logits)
    trace_dir = os.path.join("/tmp", "trace_" + name)
    with (jax.profiler.trace(trace_dir) if args.profile_steps else contextlib.nullcontext()):
        for _ in range(args.profile_steps):
            engine.step()
        engine.drain()
        jax.block_until_ready(runner.execute(batch))
    for root, _, files in os.walk(trace_dir):
        for f in files:
            if f.endswith(".trace.json.gz"):
                os.replace(os.path.join(root, f), os.path.join(args.out, name + ".trace.json.gz"))
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(row, f, indent=1)
    for request_id in ids:
        engine.abort(request_id)


if __name__ == "__main__":
    main()
