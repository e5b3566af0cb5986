"""`bench sampling`: the ORCA trace under each way of picking tokens, on one engine in one run.

Variants (--variants, the first is the baseline every ratio is over): greedy (a); sampled (b:
temperature 0.8, top-p 0.95, top-k 50); penalties (c: b with presence 0.5, frequency 0.5 and
repetition 1.1); json_schema (d: greedy under RECORDS_SCHEMA, an allowed-token mask on every row).
All requests arrive at once and generate exactly their max_tokens (EOS ignored); each variant runs
--num-runs times, the variants taking turns, and their median runs are compared. For json_schema the
host's mask time is reported: seconds filling bitmasks per masked batch, their share of the run, and
how many batches' sampling waited for the previous batch's tokens while their forward pass ran
(async scheduling).

The issue's comparison on llama-8b:
  python -m orca_jax.bench sampling --model llama-8b --variants greedy,sampled,penalties,json_schema \\
      --result-dir DIR
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, lengths_from_args, make_trace
from orca_jax.bench.driver import run_trace
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, measured_engine
from orca_jax.sampling_params import SamplingParams
from orca_jax.structured import Constraint

# A list of records (an extraction's usual output), at least 128 of them: ~5,000 tokens at the least,
# more than any request of the trace generates, so the schema never ends a request early and every
# variant does the same work.
RECORDS_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 128, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "old", "vip"]}}}}}}}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
PENALTIES = SAMPLED | {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
VARIANTS: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda n: SamplingParams(max_tokens=n, ignore_eos=True),
    "sampled": lambda n: SamplingParams(max_tokens=n, ignore_eos=True, **SAMPLED),
    "penalties": lambda n: SamplingParams(max_tokens=n, ignore_eos=True, **PENALTIES),
    "json_schema": lambda n: SamplingParams(max_tokens=n, ignore_eos=True,
                                            structured_outputs=Constraint.json_schema(RECORDS_SCHEMA)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM,))
    parser.add_argument("--variants", default="greedy,json_schema",
                        help=f"comma list of {', '.join(VARIANTS)}; the first is the baseline")
    parser.add_argument("--num-runs", type=int, default=3, help="runs per variant, in turns; medians are compared")
    add_result_arguments(parser)


def run(args: argparse.Namespace) -> Results:
    names = args.variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench sampling: unknown variants {unknown}; choose from {list(VARIANTS)}")
    results = Results("sampling", args, args.model)
    engine, _, _ = measured_engine(args, results)
    trace = make_trace(DatasetName.UNIFORM, args.num_prompts, None, args.seed, lengths_from_args(args))
    results.section("schema", RECORDS_SCHEMA)
    rows = {name: {"runs": []} for name in names}
    # Variants take turns run by run (ABCD ABCD ...): a drift of the machine over the minutes of the
    # bench then falls on every variant alike; each is summarized by its median run.
    for run_index in range(args.num_runs):
        for name in names:
            summary = run_trace(engine, trace, realtime=False, sampling=VARIANTS[name]).summary()
            summary["mask_ms_per_masked_batch"] = 1e3 * summary["mask_s"] / max(summary["masked_batches"], 1)
            summary["mask_fraction_of_run"] = summary["mask_s"] / summary["wall_s"]
            rows[name]["runs"].append(summary)
            print(f"run {run_index} {name}: {summary['tokens_per_s']:.0f} tok/s, {summary['ms_per_iteration']:.2f} "
                  f"ms/iteration, mask {summary['mask_ms_per_masked_batch']:.3f} ms per masked batch "
                  f"({summary['masked_batches']} masked, {summary['deferred_batches']} waited)", flush=True)
    base = statistics.median(r["tokens_per_s"] for r in rows[names[0]]["runs"])
    for name in names:
        median = statistics.median(r["tokens_per_s"] for r in rows[name]["runs"])
        rows[name].update(median_tokens_per_s=median, over_baseline=median / base,
                          runs_over_baseline=[r["tokens_per_s"] / base for r in rows[name]["runs"]])
        print(f"{name}: median {median:.0f} tok/s, {median / base:.3f} of {names[0]}", flush=True)
    results.section("baseline", names[0])
    results.section("variants", rows)
    results.section("num_compiled_programs_after", engine.runner.compilation.num_compiled_programs)
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    rows = []
    for name, variant in result.get("variants", {}).items():
        last = variant["runs"][-1]
        rows.append({"variant": name, "median tok/s": variant.get("median_tokens_per_s"),
                     "over baseline": variant.get("over_baseline"), "runs": len(variant["runs"]),
                     "ms/iteration": last["ms_per_iteration"], "masked batches": last["masked_batches"] or None,
                     "mask ms/batch": last["mask_ms_per_masked_batch"] if last["masked_batches"] else None,
                     "mask share": last["mask_fraction_of_run"] if last["masked_batches"] else None,
                     "sampling waited": last["deferred_batches"] or None})
    return {"variants (median run; the mask columns from the last)": rows}
