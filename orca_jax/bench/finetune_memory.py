"""`python -m orca_jax.bench finetune-memory`: where a fine-tuning job's memory comes from, side by side in one run.

For each --fine-tuning-memory-policy (reserve, then lend), on an engine of its own:
1. the KV pool: pages, and for lend the pages a job borrows (the same bytes reserve holds back);
2. a LoRA job started: seconds to its third iteration (lend: the smaller pool's forwards compile
   meanwhile), device bytes in use, its tokens/s alone;
3. a burst: --burst-requests requests at once, each reserving prompt + max_tokens, more than the
   smaller pool holds: makespan, generated tokens/s, TTFT p50/p99, and what the loan did (parks,
   loans, seconds resizing the pool);
4. after the burst: seconds until the job iterates again, and its tokens/s.
Saves <model>_finetune_memory.json (--result-dir).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

import jax
import numpy as np

from orca_jax.bench.finetune import JOB_EPOCHS, drive_until, percentiles, synthetic_dataset
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, build_engine
from orca_jax.config import FineTuningConfig, FineTuningMemory, LoRAConfig
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--policies", default="reserve,lend", help="comma list of lend, reserve; each on its own engine")
    parser.add_argument("--memory-gib", type=float, default=8.0, help="the job's memory (--fine-tuning-memory-gib)")
    parser.add_argument("--burst-requests", type=int, default=256)
    parser.add_argument("--burst-lengths", default="1024,1024", help="prompt,max_tokens of each burst request")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--example-tokens", default="255,256", help="prompt,completion tokens of each example")
    parser.add_argument("--ft-alone-s", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    add_result_arguments(parser)


def bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def job_rate(engine: Engine, seconds: float) -> float:
    """Fine-tuning tokens/s over `seconds` of the job alone."""
    before, start = engine.stats().fine_tuning_tokens_total, time.monotonic()
    drive_until(engine, lambda: time.monotonic() - start >= seconds)
    return (engine.stats().fine_tuning_tokens_total - before) / (time.monotonic() - start)


def burst(engine: Engine, num: int, prompt: int, max_tokens: int, seed: int) -> dict:
    """`num` requests at once, to the end: makespan, tokens/s, TTFT."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    before, start = engine.stats(), time.monotonic()
    arrival, first = {}, {}
    for _ in range(num):
        rid = engine.add_request(rng.integers(1, vocab, prompt).tolist(), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        arrival[rid] = time.monotonic()
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic()
            generated += len(out.new_token_ids)
    seconds, after = time.monotonic() - start, engine.stats()
    return {"seconds": seconds, "generated_tokens_per_s": generated / seconds,
            "ttft_s": percentiles([first[r] - arrival[r] for r in first]),
            "fine_tuning_parks": after.fine_tuning_parks_total - before.fine_tuning_parks_total,
            "kv_loans": after.kv_loans_total - before.kv_loans_total,
            "kv_loan_seconds": after.kv_loan_seconds_total - before.kv_loan_seconds_total,
            "preemptions": after.num_preemptions - before.num_preemptions}


def run_policy(args: argparse.Namespace, policy: FineTuningMemory) -> dict:
    fine_tuning = FineTuningConfig(directory=tempfile.mkdtemp(prefix="orca_jax_bench_ftmem_"), memory_gib=args.memory_gib,
                                   memory_policy=policy, max_epochs=JOB_EPOCHS)
    start = time.monotonic()
    engine = build_engine(args, lora=LoRAConfig(max_loras=1, max_lora_rank=args.rank), fine_tuning=fine_tuning)
    page_tokens = engine.runner.page_size
    out = {"start_s": time.monotonic() - start, "kv_pages": engine.runner.full_pages,
           "kv_tokens": engine.runner.full_pages * page_tokens, "lendable_pages": engine.runner.lendable_pages,
           "bytes_in_use_idle": bytes_in_use()}
    tuner = engine.fine_tuning
    prompt_tokens, completion_tokens = map(int, args.example_tokens.split(","))
    records = synthetic_dataset(prompt_tokens, completion_tokens, 256, args.seed)
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    file_id = tuner.store.save_file(data, "synthetic.jsonl", "fine-tune")["id"]
    hp = TrainingHyperparameters(n_epochs=JOB_EPOCHS, batch_size=16, micro_batch_tokens=args.micro_batch_tokens,
                                 checkpoint_every=10**6)
    job_id = tuner.create_job(file_id, hp, rank=args.rank)["id"]
    started = time.monotonic()
    drive_until(engine, lambda: engine.stats().fine_tuning_iterations >= 3 or tuner.job(job_id)["status"] == "failed")
    if tuner.job(job_id)["status"] == "failed":
        raise RuntimeError(f"the fine-tuning job failed: {tuner.job(job_id)['error']}")
    out["job_start_s"] = time.monotonic() - started
    out["bytes_in_use_job"] = bytes_in_use()
    out["kv_pages_lent"] = engine.stats().kv_pages_lent
    out["job_alone_tokens_per_s"] = job_rate(engine, args.ft_alone_s)
    prompt, max_tokens = map(int, args.burst_lengths.split(","))
    out["burst"] = burst(engine, args.burst_requests, prompt, max_tokens, args.seed)
    iterations, resumed = engine.stats().fine_tuning_iterations, time.monotonic()
    drive_until(engine, lambda: engine.stats().fine_tuning_iterations > iterations)
    out["job_resume_s"] = time.monotonic() - resumed
    out["job_after_tokens_per_s"] = job_rate(engine, args.ft_alone_s / 2)
    out["events"] = [e["message"] for e in tuner.store.events(job_id)][-6:]
    tuner.cancel(job_id)
    return out


def run(args: argparse.Namespace) -> Results:
    results = Results("finetune_memory", args, args.model)
    for name in args.policies.split(","):
        results.section(name, run_policy(args, FineTuningMemory(name)))
        gc.collect()  # the engine and its pool go before the next one is built
    if "lend" in results and "reserve" in results:
        lend, reserve = results["lend"], results["reserve"]
        results.section("summary", {
            "kv_tokens": {"lend": lend["kv_tokens"], "reserve": reserve["kv_tokens"]},
            "burst_tokens_per_s_lend_over_reserve": lend["burst"]["generated_tokens_per_s"]
            / reserve["burst"]["generated_tokens_per_s"],
            "job_alone_lend_over_reserve": lend["job_alone_tokens_per_s"] / reserve["job_alone_tokens_per_s"],
            "parks": lend["burst"]["fine_tuning_parks"], "loan_seconds": lend["burst"]["kv_loan_seconds"]})
        print(json.dumps(results["summary"], indent=1))
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    """One row per policy: the pool, the job, the burst."""
    rows = []
    for name in ("reserve", "lend"):
        if name not in result:
            continue
        policy, burst_ = result[name], result[name]["burst"]
        rows.append({"policy": name, "KV tokens": policy["kv_tokens"], "pages lent": policy["kv_pages_lent"],
                     "job alone tok/s": policy["job_alone_tokens_per_s"], "burst tok/s": burst_["generated_tokens_per_s"],
                     "burst TTFT p50 s": burst_["ttft_s"]["p50"], "burst TTFT p99 s": burst_["ttft_s"]["p99"],
                     "parks": burst_["fine_tuning_parks"], "resize s": burst_["kv_loan_seconds"],
                     "job back after s": policy["job_resume_s"]})
    return {"fine-tuning memory": rows}
