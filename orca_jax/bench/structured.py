"""The ORCA trace with a JSON schema on every request, next to greedy, on one engine in one run.

`python -m orca_jax.bench structured --model llama-8b --out DIR` runs the paper's uniform trace
(all requests at t=0, exactly max_tokens each) twice per variant on one engine and reports the warm
run's tokens/s over greedy's, and the host's mask time: seconds filling allowed-token bitmasks per
batch that had a constrained row (EngineStats.mean_structured_mask_seconds).

The schema (RECORDS_SCHEMA) is a realistic extraction shape that cannot be complete before far
more tokens than the trace asks for, so every request still generates exactly its max_tokens and
the variants do the same work; only the masks differ. Results go to DIR/<model>_structured.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Callable

import jax

from orca_jax.bench.core import CoreSetup, engine_config, greedy, random_model, run_trace
from orca_jax.bench.traces import TraceKind, make_trace
from orca_jax.engine import Engine
from orca_jax.request import SamplingParams
from orca_jax.structured import Constraint

# A list of records (an extraction's usual output), at least 128 of them: ~5,000 tokens at the
# least, more than any request of the trace generates.
RECORDS_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 128, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "old", "vip"]}}}}}}}


def _json_schema(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=Constraint.json_schema(RECORDS_SCHEMA))


VARIANTS: dict[str, Callable[[int], SamplingParams]] = {"greedy": greedy, "json_schema": _json_schema}


def run_structured(setup: CoreSetup, out_dir: str, variants: tuple[str, ...] = tuple(VARIANTS),
                   cache_dir: str | None = None) -> dict:
    """Each variant's two runs of the uniform trace on one engine; ratios to the first variant."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    os.makedirs(out_dir, exist_ok=True)
    engine = Engine(engine_config(setup, compilation_cache_dir=cache_dir or tempfile.mkdtemp(prefix="orca_jax_")),
                    random_model(setup.model, setup.dtype))
    trace = make_trace(TraceKind.UNIFORM, setup.num_requests, None, 0, setup.lengths)
    result: dict = {"setup": dataclasses.asdict(setup) | {"lengths": str(setup.lengths)},
                    "device": jax.devices()[0].device_kind, "command": " ".join(sys.argv),
                    "schema": RECORDS_SCHEMA, "variants": {}}
    for name in variants:
        runs = []
        for _ in range(2):  # the second is the warm one
            before = engine.stats()
            run = run_trace(engine, trace, VARIANTS[name])
            after = engine.stats()
            masked = after.structured_masked_batches - before.structured_masked_batches
            mask_s = after.structured_mask_seconds_total - before.structured_mask_seconds_total
            runs.append(run | {"masked_batches": masked, "masked_rows": after.structured_masked_rows
                               - before.structured_masked_rows, "mask_s": mask_s,
                               "mask_ms_per_masked_batch": 1e3 * mask_s / max(masked, 1),
                               "mask_fraction_of_run": mask_s / run["seconds"]})
        result["variants"][name] = {"runs": runs}
    first = result["variants"][variants[0]]["runs"][-1]
    for name in variants:
        warm = result["variants"][name]["runs"][-1]
        warm["over_" + variants[0]] = warm["tokens_per_s"] / first["tokens_per_s"]
    result["num_compiled_programs"] = engine.runner.compilation.num_compiled_programs
    with open(os.path.join(out_dir, f"{setup.model}_structured.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result
