"""Engine microbenchmark (ORCA Fig. 9): a batch of identical requests, time until the batch is done."""

from __future__ import annotations

from orca_jax.bench import driver, roofline
from orca_jax.bench.traces import identical_trace
from orca_jax.engine import Engine

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def microbench(engine: Engine, costs: roofline.ModelCosts, peaks: roofline.Peaks,
               input_lens=(32, 128), max_tokens: int = 32, batch_sizes=BATCH_SIZES, repeats: int = 2,
               deadline=None) -> list[dict]:
    """One row per (input length, batch size): best-of-repeats seconds for the whole batch."""
    rows = []
    largest = engine.config.scheduler.max_num_seqs
    for input_len in input_lens:
        for bs in batch_sizes:
            if bs > largest or (deadline is not None and deadline.expired()):
                continue
            driver.use_scheduler(engine, driver.ORCA, bs)
            trace = identical_trace(bs, input_len, max_tokens)
            runs = [driver.run_trace(engine, trace, f"micro-{input_len}-{bs}", realtime=False)
                    for _ in range(repeats)]
            best = min(runs, key=lambda r: r.wall_s)
            summary = best.summary()
            rows.append({
                "input_len": input_len, "max_tokens": max_tokens, "batch_size": bs,
                "batch_seconds": best.wall_s, "all_seconds": [r.wall_s for r in runs],
                "iterations": best.iterations, "tokens_per_s": bs * max_tokens / best.wall_s,
                "host_s_per_iter": summary["host_s_per_iter"],
                "device_wait_s_per_iter": summary["device_wait_s_per_iter"],
                "roofline": roofline.run_bound(costs, peaks, best.records, best.wall_s)})
    return rows
