"""Host time of the scheduler's side of one iteration (schedule, build the batch, update), prefix
caching off and on, on the ORCA trace's shapes (512 requests, prompts 32-512, outputs 1-128; pool
8,192 pages of 16, 2,048 tokens x 128 sequences), no device. Off and on alternate twice.

    PYTHONPATH=. python benchmarks/probes/host_replay.py

host_replay_prefix_caching.json is its output on the H100 machine's host.
"""
import random
import statistics
import time

from orca_jax.config import SchedulerConfig
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.input_batch import BucketPolicy, build_batch


def run(caching, seed=0, n=512):
    rng = random.Random(seed)
    kv = KVCacheManager(1 + 8192, 16, enable_prefix_caching=caching)
    buckets = BucketPolicy(max_num_batched_tokens=2048, max_num_seqs=128, max_pages=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048, async_scheduling=False), kv, 1024,
                      token_target=buckets.token_target)
    for i in range(n):
        p = rng.randint(32, 512); o = rng.randint(1, 128)
        sched.add_request(Request(str(i), [rng.randrange(3, 32000) for _ in range(p)], SamplingParams(max_tokens=o, ignore_eos=True)))
    times = []
    while sched.has_unfinished():
        t0 = time.perf_counter()
        out = sched.schedule()
        build_batch(out, buckets)
        sched.update(out, [7] * out.num_requests)
        times.append(time.perf_counter() - t0)
    return times

for caching in (False, True, False, True):
    t = run(caching)
    print(f"caching={caching}: {len(t)} iterations, mean {statistics.mean(t)*1e3:.3f} ms, median {statistics.median(t)*1e3:.3f} ms, total {sum(t):.3f} s")
