"""One engine iteration of the llama-8b shape at batch 64 (increments at kv ~1024): Pallas kernel vs jnp path.

Random bf16 weights. Each backend: 64 requests with 1000-token prompts are fed (chunked) until every request
is in its increment phase, then the median wall time of whole engine iterations (schedule, batch, dispatch,
device, tokens back) is taken over 20 iterations after 3 warm-up ones.
Run: python -m orca_jax.bench iteration $OUT/engine_iteration.json
"""

import json
import statistics
import sys
import time

import jax
import numpy as np

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.request import SamplingParams


def measure(backend: str) -> dict:
    config = EngineConfig(model="llama-8b", cache=CacheConfig(page_size=16, kv_memory_gib=12.0),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
                          attention=AttentionBackend(backend), max_model_len=2048)
    engine = Engine(config)
    rng = np.random.default_rng(0)
    for _ in range(64):
        engine.add_request(rng.integers(3, 100_000, 1000).tolist(), SamplingParams(max_tokens=100, ignore_eos=True))
    while any(r.in_initiation for r in engine.scheduler.requests):  # every request past its prompt
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    stats = engine.stats()
    return {"backend": backend, "median_iteration_ms": 1e3 * statistics.median(times),
            "min_iteration_ms": 1e3 * min(times), "batch_size": stats.last_batch_size,
            "tokens": stats.last_num_tokens}


def main(out_path: str):
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": "llama-8b (random, bf16)",
               "rows": []}
    for backend in ("pallas", "jnp"):
        results["rows"].append(measure(backend))
        print(results["rows"][-1], flush=True)
        jax.clear_caches()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
