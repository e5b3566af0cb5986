"""Compile every bucket an engine can meet before timing starts, so compile time stays out of the runs.

The runner compiles lazily (one program per bucket on first use); here every (T, S, P) bucket of the
engine's BucketPolicy up to a KV length goes through ModelRunner.precompile, which keeps the
executables, and each forward program is run once so first-call costs are paid here too.
"""

from __future__ import annotations

import time

import numpy as np

from orca_jax.batch import empty_batch
from orca_jax.engine import Engine


def bucket_shapes(engine: Engine, max_kv_tokens: int) -> list[tuple[int, int, int]]:
    """Every (T, S, P) bucket an iteration can land in when no sequence exceeds max_kv_tokens."""
    return engine.buckets.all_buckets(max_pages=engine.kv.num_pages_for(max_kv_tokens))


def precompile(engine: Engine, max_kv_tokens: int, threads: int | None = None) -> dict:
    """Compile all buckets' programs (the all-greedy sampler benchmarks call); what and how long."""
    runner = engine.runner
    shapes = bucket_shapes(engine, max_kv_tokens)
    start = time.perf_counter()
    seconds = runner.precompile([(t, s, p, 0, True) for t, s, p in shapes], threads=threads)
    for t, s, p in shapes:
        np.asarray(runner.execute(empty_batch(t, s, p)))
    return {"num_forward_programs": len(shapes), "num_sample_programs": len({s for _, s, _ in shapes}),
            "compile_s": seconds, "total_s": time.perf_counter() - start,
            "shapes": [list(x) for x in shapes]}
