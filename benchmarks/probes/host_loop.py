"""The engine's per-request host phases with no engine and no device: schedule -> build_batch (with the
sampling rows) -> update with random tokens -> a RequestOutput per row, N requests decoding (32-token
prompts, byte tokenizer, prefix caching on), µs per step by phase, medians of 120 steps after 20.
Steadier than host_profile.py on a shared CPU (no XLA threads beside it). `async`: async scheduling,
each batch planned while the one before it is in flight (its rows fed from the device's samples).

    PYTHONPATH=. python benchmarks/probes/host_loop.py 256 [stop] [async]   # stop: every request has a stop string
"""
import statistics
import sys
import time

import numpy as np

from orca_jax.config import SchedulerConfig
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.output_processor import request_output
from orca_jax.sample.batcher import SamplingBatcher
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import ByteTokenizer
from orca_jax.worker.input_batch import BucketPolicy, build_batch

PHASES = ("schedule", "build", "update", "output")


def run(num_seqs: int, stop: bool, async_scheduling: bool = False, steps: int = 120, warmup: int = 20,
        prompt_len: int = 32) -> dict:
    tokenizer = ByteTokenizer(eos_token_ids=(2,), bos_token_id=1)
    kv = KVCacheManager(1 + num_seqs * 32, 16, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=512, async_scheduling=async_scheduling)
    scheduler = Scheduler(config, kv, 512, 2 if async_scheduling else 1)
    buckets = BucketPolicy(max_num_batched_tokens=512, max_num_seqs=num_seqs, max_pages=32)
    sampling = SamplingBatcher(0, 256, 8)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0, stop=("zzzq",) if stop else ())
    for i in range(num_seqs):
        scheduler.add_request(Request(f"r{i}", rng.integers(3, 256, prompt_len).tolist(), params, eos_token_ids=(2,),
                                      detokenizer=IncrementalDetokenizer(tokenizer, params.stop), seed=i))
    times = {phase: [] for phase in PHASES}
    in_flight = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()  # async: while the previous plan is in flight
        t1 = time.perf_counter()
        build_batch(plan, buckets, sampling)
        t2 = time.perf_counter()
        in_flight.append(plan)
        returned = in_flight.pop(0) if len(in_flight) > async_scheduling else None
        tokens = rng.integers(3, 256, len(returned.scheduled)).tolist() if returned else []
        t3 = time.perf_counter()
        if returned:
            scheduler.update(returned, tokens)
        t4 = time.perf_counter()
        for row in returned.scheduled if returned else ():
            num_new = len(row.request.output_token_ids) - row.step
            if num_new > 0:
                request_output(row.request, num_new)
        t5 = time.perf_counter()
        if step >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                times[phase].append(seconds)
    return {phase: 1e6 * statistics.median(values) for phase, values in times.items()}


if __name__ == "__main__":
    num_seqs, stop, async_scheduling = int(sys.argv[1]), "stop" in sys.argv[2:], "async" in sys.argv[2:]
    result = run(num_seqs, stop, async_scheduling)
    total = sum(result.values())
    print(f"{num_seqs} sequences{', stop strings' if stop else ''}{', async' if async_scheduling else ''}: "
          + " ".join(f"{phase} {us:.0f}" for phase, us in result.items())
          + f" | total {total:.0f} µs a step, {total / num_seqs:.1f} µs a request")
