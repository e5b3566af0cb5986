"""The engine's per-request host phases with no engine and no device: schedule -> build_batch (with the
sampling rows) -> update with random tokens -> a RequestOutput per row, N requests decoding (32-token
prompts, byte tokenizer, prefix caching on, async scheduling off), µs per step by phase, medians of
120 steps after 20. Steadier than host_profile.py on a shared CPU (no XLA threads beside it).

    PYTHONPATH=. python benchmarks/probes/host_loop.py 256 [stop]   # stop: every request has a stop string
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


def run(num_seqs: int, stop: bool, steps: int = 120, warmup: int = 20, prompt_len: int = 32) -> dict:
    tokenizer = ByteTokenizer(eos_token_ids=(2,), bos_token_id=1)
    kv = KVCacheManager(1 + num_seqs * 32, 16, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=512, async_scheduling=False)
    scheduler = Scheduler(config, kv, 512, 1)
    buckets = BucketPolicy(max_num_batched_tokens=512, max_num_seqs=num_seqs, max_pages=32)
    sampling = SamplingBatcher(0, 256, 8)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0, stop=("zzzq",) if stop else ())
    for i in range(num_seqs):
        scheduler.add_request(Request(f"r{i}", rng.integers(3, 256, prompt_len).tolist(), params, eos_token_ids=(2,),
                                      detokenizer=IncrementalDetokenizer(tokenizer, params.stop), seed=i))
    times = {phase: [] for phase in PHASES}
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        build_batch(plan, buckets, sampling)
        t2 = time.perf_counter()
        tokens = rng.integers(3, 256, len(plan.scheduled)).tolist()
        t3 = time.perf_counter()
        scheduler.update(plan, tokens)
        t4 = time.perf_counter()
        for row in plan.scheduled:
            request_output(row.request, len(row.request.output_token_ids) - row.step)
        t5 = time.perf_counter()
        if step >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                times[phase].append(seconds)
    return {phase: 1e6 * statistics.median(values) for phase, values in times.items()}


if __name__ == "__main__":
    num_seqs, stop = int(sys.argv[1]), len(sys.argv) > 2
    result = run(num_seqs, stop)
    total = sum(result.values())
    print(f"{num_seqs} sequences{', stop strings' if stop else ''}: "
          + " ".join(f"{phase} {us:.0f}" for phase, us in result.items())
          + f" | total {total:.0f} µs a step, {total / num_seqs:.1f} µs a request")
