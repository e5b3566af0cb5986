"""The one device-timing helper the benchmarks share."""

from __future__ import annotations

import statistics
import time

import jax


def time_call(fn, *args, warmup: int = 3, iters: int = 10, reps: int = 7) -> float:
    """Median over `reps` rounds of the seconds per call, each round `iters` calls back to back
    (asynchronous dispatch, one wait at the end), after `warmup` waited calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)
