"""`python -m orca_jax.bench finetune`: inference and a LoRA fine-tuning job sharing one device (FineInfer's
Deferred Continuous Batching), in one run, in process.

1. capacity: the trace's requests all at once, inference alone: requests/s the rates are fractions of;
2. inference alone: Poisson arrivals at three rates (light, medium, near saturation): TTFT and TPOT
   p50/p99;
3. the job alone: a LoRA job (rank `rank` on every projection) on a synthetic dataset, no requests:
   fine-tuning tokens/s;
4. inference with the job: the same three traces while the job runs: TTFT and TPOT p50/p99 and the
   job's tokens/s, under Deferred Continuous Batching alone (`with_job`) and then for each
   --max-inference-slowdowns value above 1 (`beside`: iterations also run while requests run), and for
   each --tpot-slo-factors value (`tpot_slo`: beside running requests within a TPOT SLO of that factor
   times the medium rate's p99 TPOT alone, as an operator would set it from what they observe).
Saves <model>_finetune.json (--result-dir) and prints the issue's targets: at the medium rate inference p99 TPOT
within 1.2x of inference alone; at the light rate fine-tuning keeps >= 50% of its alone throughput.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import numpy as np

from orca_jax.bench.datasets import DatasetName, Trace, add_dataset_arguments, lengths_from_args, make_trace
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, build_engine
from orca_jax.config import FineTuningConfig, LoRAConfig
from orca_jax.engine import Engine
from orca_jax.finetune.data import TrainingPlan, examples_from_records
from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters, resolve_targets
from orca_jax.finetune.trainer import LoRATrainer
from orca_jax.sampling_params import SamplingParams

TPOT_TARGET = 1.2  # medium rate: p99 TPOT with the job over alone, at most
FT_TARGET = 0.5  # light rate: fine-tuning tokens/s with inference over alone, at least
# The measured job's epochs: more than any run lasts. A server refuses so many by default
# (FineTuningConfig.max_epochs); the bench, its own operator, lifts its engine's limit to it.
JOB_EPOCHS = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_dataset_arguments(parser, num_prompts=256, lists=False, names=(DatasetName.UNIFORM,))
    parser.add_argument("--rate-fractions", default="0.2,0.5,0.9",
                        help="light, medium, near saturation: fractions of the capacity (--num-prompts at once)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="each Poisson run's arrivals")
    parser.add_argument("--ft-alone-s", type=float, default=15.0)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--example-tokens", default="255,256",
                        help="prompt,completion tokens of each example (with the end token: 512, one row)")
    parser.add_argument("--deferral-bound-s", type=float, default=FineTuningConfig().deferral_bound_s)
    parser.add_argument("--max-inference-slowdowns", default="1.2",
                        help="after Deferred Continuous Batching alone, the traces again with the job also "
                        "running beside requests at each of these slowdowns (comma list; empty: none)")
    parser.add_argument("--tpot-slo-factors", default="1.2",
                        help="then the traces again with the job running beside requests within a TPOT SLO of each "
                        "factor times the medium rate's p99 TPOT alone (comma list; empty: none)")
    parser.add_argument("--memory-gib", type=float, default=8.0, help="held back from the KV pool for the job")
    add_result_arguments(parser)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)), "n": len(values)}


def run_poisson(engine: Engine, trace: Trace) -> dict:
    """Requests added at their arrival times (EOS ignored) while the engine steps; TTFT and TPOT from the
    outputs' arrival on the host, and the fine-tuning tokens/s meanwhile."""
    vocab = engine.model_config.vocab_size
    before = engine.stats()
    policy = engine.fine_tuning.policy.stats if engine.fine_tuning is not None else None
    beside_before = (policy.beside, policy.beside_seconds) if policy is not None else (0, 0.0)
    start = time.monotonic()
    arrival, first, done, count = {}, {}, {}, {}
    added = 0
    while added < len(trace) or engine.has_unfinished():
        now = time.monotonic()
        while added < len(trace) and now - start >= trace.requests[added].arrival:
            r = trace.requests[added]
            rid = engine.add_request(trace.prompt_ids(added, vocab), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                     arrival_time=now)
            arrival[rid] = now
            added += 1
        if not engine.has_work():
            time.sleep(0.0005)
            continue
        for out in engine.step():
            t = time.monotonic()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = t
            if out.finished:
                done[out.request_id], count[out.request_id] = t, len(out.output_token_ids)
    seconds = time.monotonic() - start
    after = engine.stats()
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(done[r] - first[r]) / (count[r] - 1) for r in done if count[r] > 1]
    ft_tokens = after.fine_tuning_tokens_total - before.fine_tuning_tokens_total
    return {"rate": trace.rate, "num_requests": len(trace), "seconds": seconds, "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot), "fine_tuning_tokens": ft_tokens, "fine_tuning_tokens_per_s": ft_tokens / seconds,
            "inference_deferrals": after.inference_deferrals_total - before.inference_deferrals_total,
            "inference_deferral_s": after.inference_deferral_seconds_total - before.inference_deferral_seconds_total,
            # iterations run beside running requests (a slowdown above 1 or a TPOT SLO), and their time
            "fine_tuning_beside": policy.beside - beside_before[0] if policy is not None else 0,
            "fine_tuning_beside_s": policy.beside_seconds - beside_before[1] if policy is not None else 0.0}


def capacity(engine: Engine, trace: Trace) -> float:
    """Requests per second with every request queued at once."""
    start = time.monotonic()
    for i, r in enumerate(trace.requests):
        engine.add_request(trace.prompt_ids(i, engine.model_config.vocab_size),
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return len(trace) / (time.monotonic() - start)


def synthetic_dataset(prompt_tokens: int, completion_tokens: int, num: int, seed: int) -> list[dict]:
    """Prompt/completion records of random letters (one byte token each with a byte tokenizer)."""
    rng = np.random.default_rng(seed)
    text = lambda n: "".join(chr(c) for c in rng.integers(97, 123, n))
    return [{"prompt": text(prompt_tokens), "completion": text(completion_tokens)} for _ in range(num)]


def drive_until(engine: Engine, until, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("the fine-tuning job did not get there in time")
        if engine.has_work():
            engine.step()
        else:
            time.sleep(0.005)


def run(args: argparse.Namespace) -> Results:
    lengths = lengths_from_args(args)
    results = Results("finetune", args, args.model)
    jobs_dir = tempfile.mkdtemp(prefix="orca_jax_bench_finetune_")
    fine_tuning = FineTuningConfig(directory=jobs_dir, deferral_bound_s=args.deferral_bound_s, memory_gib=args.memory_gib,
                                   max_epochs=JOB_EPOCHS)
    start = time.monotonic()
    engine = build_engine(args, lora=LoRAConfig(max_loras=1, max_lora_rank=args.rank), fine_tuning=fine_tuning)
    result = {"fine_tuning": dataclasses.asdict(fine_tuning), "start_s": time.monotonic() - start,
              "kv_pages": engine.stats().kv_pages_total}
    # The job's programs compile (into jax's persistent cache) before anything is timed: compiling
    # beside the inference-alone runs took host cores from them and skewed the baseline (an H100 run
    # measured TPOT p99 alone 3x above TPOT p99 with the job at the medium rate).
    prompt_tokens, completion_tokens = map(int, args.example_tokens.split(","))
    records = synthetic_dataset(prompt_tokens, completion_tokens, 256, args.seed)
    hp = TrainingHyperparameters(n_epochs=JOB_EPOCHS, batch_size=16, micro_batch_tokens=args.micro_batch_tokens,
                                 checkpoint_every=10**6)
    spec = LoRASpec(args.rank, 2.0 * args.rank, resolve_targets(None, engine.model_config.family))
    plan = TrainingPlan.make(examples_from_records(records, engine.tokenizer, engine.max_model_len), hp.batch_size,
                             hp.n_epochs, hp.seed, hp.micro_batch_tokens, engine.max_model_len)
    stage = engine.runner.stages[0]
    compile_start = time.monotonic()
    early = LoRATrainer(stage.model, stage.params, spec, hp, (plan.rows, plan.length), plan.total_steps,
                        stage.replicated, fine_tuning.remat, int(fine_tuning.memory_gib * 2**30)).start_compiling()
    early.result()
    result["job_compile_s"] = time.monotonic() - compile_start
    result["capacity_rps"] = capacity(engine, make_trace(DatasetName.UNIFORM, args.num_prompts, None, args.seed, lengths))
    rates = [f * result["capacity_rps"] for f in map(float, args.rate_fractions.split(","))]
    traces = [make_trace(DatasetName.UNIFORM, max(2, round(rate * args.duration_s)), rate, args.seed, lengths)
              for rate in rates]
    result["alone"] = [run_poisson(engine, trace) for trace in traces]
    results.section("finetune", result)

    tuner = engine.fine_tuning
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    file_id = tuner.store.save_file(data, "synthetic.jsonl", "fine-tune")["id"]
    job_id = tuner.create_job(file_id, hp, rank=args.rank)["id"]
    started = time.monotonic()
    drive_until(engine, lambda: engine.stats().fine_tuning_iterations >= 3 or tuner.job(job_id)["status"] == "failed")
    job = tuner.job(job_id)
    if job["status"] == "failed":
        result["job_error"] = job["error"]
        results.section("finetune", result)
        raise RuntimeError(f"the fine-tuning job failed: {job['error']}")
    events = tuner.store.events(job_id)
    result["job_start_s"] = time.monotonic() - started
    result["job_memory"] = next((e["data"] for e in events if "temp_bytes" in e["data"]), None)
    before, t0 = engine.stats(), time.monotonic()
    drive_until(engine, lambda: time.monotonic() - t0 >= args.ft_alone_s)
    after = engine.stats()
    result["job_alone"] = {"seconds": time.monotonic() - t0,
                           "tokens_per_s": (after.fine_tuning_tokens_total - before.fine_tuning_tokens_total)
                           / (time.monotonic() - t0),
                           "iteration_s": tuner.policy.iteration_estimate}
    result["with_job"] = [run_poisson(engine, trace) for trace in traces]
    results.section("finetune", result)
    result["beside"] = {}
    for slowdown in [float(k) for k in args.max_inference_slowdowns.split(",") if k]:
        tuner.policy.set_limits(max_inference_slowdown=slowdown)
        result["beside"][str(slowdown)] = [run_poisson(engine, trace) for trace in traces]
        results.section("finetune", result)
    tuner.policy.set_limits()
    result["tpot_slo"] = {}
    medium_alone = result["alone"][len(traces) // 2]["tpot_s"]["p99"]
    for factor in [float(f) for f in args.tpot_slo_factors.split(",") if f]:
        if medium_alone is None:  # a trace without two-token requests: nothing to set the SLO from
            break
        tuner.policy.set_limits(tpot_slo_s=factor * medium_alone)
        result["tpot_slo"][str(factor)] = {"tpot_slo_s": tuner.policy.tpot_slo_s,
                                           "runs": [run_poisson(engine, trace) for trace in traces]}
        results.section("finetune", result)
    tuner.policy.set_limits()
    tuner.cancel(job_id)
    result["summary"] = summary(result)
    results.section("finetune", result)
    print(json.dumps(result["summary"], indent=1))
    return results


def summary(result: dict) -> dict:
    """The targets under Deferred Continuous Batching alone, and per slowdown beside running requests."""
    out = _targets(result["alone"], result["with_job"], result["job_alone"]["tokens_per_s"])
    out["beside"] = {k: _targets(result["alone"], runs, result["job_alone"]["tokens_per_s"])
                     for k, runs in result.get("beside", {}).items()}
    out["tpot_slo"] = {k: {"tpot_slo_s": slo["tpot_slo_s"]}
                       | _targets(result["alone"], slo["runs"], result["job_alone"]["tokens_per_s"])
                       for k, slo in result.get("tpot_slo", {}).items()}
    return out


def _targets(alone: list[dict], shared: list[dict], ft: float) -> dict:
    medium = len(alone) // 2
    tpot_ratio = (shared[medium]["tpot_s"]["p99"] or 0) / max(alone[medium]["tpot_s"]["p99"] or 1e-9, 1e-9)
    ft_kept = shared[0]["fine_tuning_tokens_per_s"] / max(ft, 1e-9)
    rows = [{"rate": a["rate"], "ttft_p50_alone": a["ttft_s"]["p50"], "ttft_p99_alone": a["ttft_s"]["p99"],
             "ttft_p50_job": s["ttft_s"]["p50"], "ttft_p99_job": s["ttft_s"]["p99"],
             "tpot_p50_alone": a["tpot_s"]["p50"], "tpot_p99_alone": a["tpot_s"]["p99"],
             "tpot_p50_job": s["tpot_s"]["p50"], "tpot_p99_job": s["tpot_s"]["p99"],
             "ft_tokens_per_s": s["fine_tuning_tokens_per_s"], "ft_kept": s["fine_tuning_tokens_per_s"] / max(ft, 1e-9)}
            for a, s in zip(alone, shared)]
    return {"rows": rows, "ft_alone_tokens_per_s": ft,
            "medium_tpot_p99_ratio": tpot_ratio, "medium_tpot_target": TPOT_TARGET,
            "medium_tpot_met": tpot_ratio <= TPOT_TARGET,
            "light_ft_kept": ft_kept, "light_ft_target": FT_TARGET, "light_ft_met": ft_kept >= FT_TARGET}


def tables(result: dict) -> dict[str, list[dict]]:
    found = summary(result["finetune"])
    out = {"serving with and without the job": found["rows"],
           "summary": [{k: v for k, v in found.items() if k not in ("rows", "beside", "tpot_slo")}]}
    for slowdown, beside in found["beside"].items():
        out[f"beside running requests, slowdown {slowdown}"] = beside["rows"]
        out["summary"].append({"max_inference_slowdown": slowdown} | {k: v for k, v in beside.items() if k != "rows"})
    for factor, slo in found["tpot_slo"].items():
        out[f"beside running requests, TPOT SLO {factor}x the medium rate's p99 alone"] = slo["rows"]
        out["summary"].append({"tpot_slo_factor": factor} | {k: v for k, v in slo.items() if k != "rows"})
    return out
