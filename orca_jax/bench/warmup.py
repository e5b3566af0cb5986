"""Compile every bucket an engine can meet before timing starts, so compile time stays out of the runs.

Engines compile all their programs at start (EngineConfig.precompile); this reports what that took,
or does it now for an engine built with precompile off.
"""

from __future__ import annotations

import time

from orca_jax.compilation import ForwardKey, SampleKey, StageInKey
from orca_jax.engine import Engine


def precompile(engine: Engine, max_kv_tokens: int | None = None, threads: int | None = None) -> dict:
    """Compile (if not yet) and run once every program of the engine; what and how long.

    max_kv_tokens and threads are accepted for older callers: the page-table width is fixed now, so
    one program per token bucket covers every KV length.
    """
    del max_kv_tokens, threads
    start = time.perf_counter()
    report = engine.precompile()
    keys = engine.program_keys()
    return {"num_forward_programs": sum(isinstance(k, ForwardKey) for k in keys),
            "num_stage_in_programs": sum(isinstance(k, StageInKey) for k in keys),
            "num_sample_programs": sum(isinstance(k, SampleKey) for k in keys),
            "newly_compiled": report.num_programs, "compile_s": report.compile_seconds,
            "total_s": time.perf_counter() - start,
            "shapes": [[*k.bucket, k.stage] for k in keys if isinstance(k, ForwardKey)]}
