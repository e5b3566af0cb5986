"""One model's whole GPU suite in one process, writing its JSON after every section.

Order: the Hugging Face peer (a subprocess, before JAX takes the GPU), then peaks, the engine and its
compiled buckets, correctness checks, offline throughput (ours, the baseline, one at a time), the
engine microbenchmark, the end-to-end sweep and the padding arithmetic. A deadline skips what no
longer fits, so a run cut short still leaves results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

from orca_jax.bench import checks, driver, e2e, microbench, padding, roofline, warmup
from orca_jax.bench.traces import LengthSpec, TraceKind, make_trace
from orca_jax.config import AttentionBackend
from orca_jax.models.loader import LoadedModel
from orca_jax.models.presets import PRESETS
from orca_jax.tokenizer import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class Profile:
    offline_requests: int = 512
    orca_batch_sizes: tuple[int, ...] = (128,)
    baseline_batch_sizes: tuple[int, ...] = (32, 128)
    alone_requests: int = 8  # one-at-a-time subset for the engine issue
    mixed_requests: int = 64
    micro_input_lens: tuple[int, ...] = (32, 128)
    micro_batch_sizes: tuple[int, ...] = microbench.BATCH_SIZES
    e2e_configs: tuple[tuple[str, int], ...] = (("orca", 32), ("orca", 128), ("baseline", 8), ("baseline", 32))
    e2e_fractions: tuple[float, ...] = (0.15, 0.35, 0.6, 0.85, 1.1)
    point_seconds: float = 5.0
    max_point_requests: int = 150
    min_point_requests: int = 48
    check_engines: bool = False


PROFILES = {
    "full": Profile(),
    "smoke": Profile(offline_requests=64, orca_batch_sizes=(64,), baseline_batch_sizes=(16, 64),
                     micro_input_lens=(128,), micro_batch_sizes=(1, 8, 32, 128),
                     e2e_configs=(("orca", 32), ("baseline", 16)), e2e_fractions=(0.3, 0.7),
                     point_seconds=3.0, max_point_requests=64, check_engines=True),
    "plumbing": Profile(offline_requests=16, orca_batch_sizes=(16,), baseline_batch_sizes=(8,), alone_requests=3,
                        mixed_requests=8, micro_input_lens=(32,), micro_batch_sizes=(1, 4),
                        e2e_configs=(("orca", 8), ("baseline", 8)), e2e_fractions=(0.5,), point_seconds=1.0,
                        max_point_requests=16),
    "small": Profile(micro_batch_sizes=(1, 8, 32, 128), e2e_configs=(("orca", 128), ("baseline", 32)),
                     point_seconds=3.0),
    # Low rates for a request-level baseline that saturates early (pass --capacity and --e2e-configs).
    "lowrate": Profile(e2e_fractions=(0.04, 0.08, 0.12, 0.16), min_point_requests=32),
    "quick": Profile(offline_requests=256, baseline_batch_sizes=(32,), alone_requests=8,
                     micro_input_lens=(128,), micro_batch_sizes=(1, 8, 32, 128),
                     e2e_configs=(("orca", 64), ("baseline", 32)), e2e_fractions=(0.2, 0.5, 0.8)),
}

# Engine sizing per model on one 80 GB GPU: KV pool, per-iteration token budget; all bf16.
MODEL_SETTINGS = {
    "smollm2-135m": dict(kv_gib=8.0, max_num_batched_tokens=2048),
    "llama-1b": dict(kv_gib=16.0, max_num_batched_tokens=2048),
    "llama-8b": dict(kv_gib=40.0, max_num_batched_tokens=2048),
    "gpt3-13b": dict(kv_gib=40.0, max_num_batched_tokens=2048),
    # CPU runs of this file's own plumbing; its max_seq_len (512) needs shorter requests.
    "tiny-llama": dict(kv_gib=0.25, max_num_batched_tokens=128, lengths=LengthSpec(prompt_range=(8, 200), gen_range=(1, 64))),
}
MAX_MODEL_LEN = 1024  # the trace's longest request is 640 tokens
MAX_BATCH = 128


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self, margin: float = 0.0) -> bool:
        return self.remaining() < margin


class Results:
    """A dict that is written to disk after every section; a failed section records its traceback."""

    def __init__(self, path: str, header: dict):
        self.path, self.data = path, dict(header)
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=float)
        os.replace(self.path + ".tmp", self.path)

    only: set[str] | None = None  # run only these sections

    def section(self, name: str, fn, deadline: Deadline | None = None, needs_s: float = 0.0):
        if self.only is not None and name not in self.only | {"peaks", "engine"}:
            return None
        if deadline is not None and deadline.expired(needs_s):
            self.data[name] = {"skipped": f"less than {needs_s:.0f}s left"}
            self.save()
            return None
        start = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        try:
            value = fn()
        except Exception as err:  # a broken section must not lose the others
            value = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            print(value["traceback"], flush=True)
        if isinstance(value, dict):
            value.setdefault("section_s", time.perf_counter() - start)
        self.data[name] = value
        self.save()
        print(f"[{time.strftime('%H:%M:%S')}] {name} done in {time.perf_counter() - start:.1f}s", flush=True)
        return value


def run_hf_subprocess(model: str, num_requests: int, seed: int, out_path: str, timeout_s: float,
                      micro: bool = True) -> dict:
    cmd = [sys.executable, "-m", "orca_jax.bench", "hf", "--model", model, "--num-requests", str(num_requests),
           "--seed", str(seed), "--out-file", out_path] + ([] if micro else ["--no-micro"])
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as err:
        tail = f"timed out after {timeout_s:.0f}s: " + str((err.stdout or b"")[-2000:])
    result = json.load(open(out_path)) if os.path.exists(out_path) else {}
    result["command"] = " ".join(cmd)
    result["log_tail"] = tail
    return result


def random_weights(model: str) -> LoadedModel:
    """The preset's shapes with params None (the runner random-initialises on device), bf16, and a byte
    tokenizer: GPU runs use random weights for every model, SmolLM2 included (its GGUF is not there)."""
    config = dataclasses.replace(PRESETS[model], dtype="bfloat16")
    return LoadedModel(config, None, ByteTokenizer(config.eos_token_ids, config.bos_token_id))


def generate_tokens(engine, prompts, max_tokens) -> dict[str, list[int]]:
    from orca_jax.request import SamplingParams
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"check{i}")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


def run_suite(model: str, profile_name: str, out_dir: str, budget_s: float, seed: int = 0,
              hf: bool = True, hf_timeout_s: float = 200.0, sections: set[str] | None = None,
              e2e_configs: tuple[tuple[str, int], ...] | None = None, capacity: float | None = None,
              tag: str | None = None) -> dict:
    """sections: run only these (peaks and engine always run); tag: write <model>_<tag>.json, which
    the report merges into <model>.json (e.g. an e2e sweep finished in a later run)."""
    profile = PROFILES[profile_name]
    if e2e_configs:
        profile = dataclasses.replace(profile, e2e_configs=tuple(e2e_configs))
    deadline = Deadline(budget_s)
    settings = MODEL_SETTINGS[model]
    config = PRESETS[model]
    lengths = settings.get("lengths", LengthSpec())
    max_kv_tokens = lengths.prompt_range[1] + lengths.gen_range[1]
    os.makedirs(out_dir, exist_ok=True)
    res = Results(os.path.join(out_dir, f"{model}_{tag}.json" if tag else f"{model}.json"), {
        "extends": model if tag else None,
        "model": model, "profile": profile_name, "profile_settings": dataclasses.asdict(profile),
        "shapes": dataclasses.asdict(config) | {"family": config.family.value, "dtype": "bfloat16",
                                                "num_params": config.num_params},
        "engine_settings": {k: v for k, v in settings.items() if k != "lengths"} | {
            "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_BATCH,
                                       "page_size": 16},
        "command": "python3 -m orca_jax.bench " + " ".join(sys.argv[1:]), "seed": seed,
        "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    offline_trace = make_trace(TraceKind.UNIFORM, profile.offline_requests, None, seed, lengths)

    res.only = sections
    if hf:
        res.section("hf", lambda: run_hf_subprocess(
            model, profile.offline_requests, seed, os.path.join(out_dir, f"{model}_hf.json"),
            # Leave the JAX half at least half of what is left, and 240 s where there is that much.
            min(hf_timeout_s, max(deadline.remaining() - min(240.0, deadline.remaining() / 2), 30))), deadline, 60)

    import jax
    res.data["device"] = {"kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
                          "jax": jax.__version__}
    peaks = res.section("peaks", lambda: roofline.measure_peaks().as_dict())
    peaks = roofline.Peaks(peaks["hbm_GB_s"] * 1e9, peaks["matmul_TFLOP_s"] * 1e12, peaks["device"])
    costs = roofline.ModelCosts.of(dataclasses.replace(config, dtype="bfloat16"))

    state = {}

    def make_engine(attention):
        budget = settings["max_num_batched_tokens"] if attention is AttentionBackend.AUTO else 256
        engine = driver.build_engine(model, max_num_seqs=MAX_BATCH, max_num_batched_tokens=budget,
                                     kv_gib=settings["kv_gib"], max_model_len=MAX_MODEL_LEN, attention=attention,
                                     dtype="bfloat16", loaded=random_weights(model))
        info = warmup.precompile(engine, max_kv_tokens=max_kv_tokens)
        probe = generate_tokens(engine, [[5] * 40, [7] * 3], [4, 4])
        assert all(len(v) == 4 for v in probe.values())
        return engine, info

    def build():
        t = time.perf_counter()
        try:
            engine, info = make_engine(AttentionBackend.AUTO)
            backend = "auto (Pallas kernel on GPU)"
        except Exception:
            failure = traceback.format_exc()[-3000:]
            print(failure, flush=True)
            state["kernel_failure"] = failure
            engine, info = make_engine(AttentionBackend.JNP)
            backend = "jnp (fallback: the kernel failed)"
        state["engine"] = engine
        return {"attention": backend, "kernel_failure": state.get("kernel_failure"),
                "token_budget": engine.config.scheduler.max_num_batched_tokens,
                "kv_pages": engine.runner.num_pages, "params_init_s": engine.runner.params_seconds,
                "precompile": info, "seconds": time.perf_counter() - t}

    res.section("engine", build)
    engine = state.get("engine")
    if engine is None:
        return res.data

    res.section("dispatch_check", lambda: {"rows": checks.dispatch_check(engine)})

    if profile.check_engines:
        res.section("attention_check", lambda: checks.attention_check(
            config.num_heads, config.num_kv_heads, config.head_dim))

        def engine_check():
            ref = driver.build_engine(model, max_num_seqs=16, max_num_batched_tokens=256, kv_gib=2.0,
                                      max_model_len=MAX_MODEL_LEN, attention=AttentionBackend.JNP, dtype="bfloat16",
                                      loaded=random_weights(model))
            trace = make_trace(TraceKind.UNIFORM, 8, None, seed + 7, lengths)
            prompts = [trace.prompt_ids(i, config.vocab_size) for i in range(8)]
            gens = [16] * 8
            driver.use_scheduler(engine, driver.ORCA, MAX_BATCH)
            ours = generate_tokens(engine, prompts, gens)
            agreement = checks.token_agreement(ours, generate_tokens(ref, prompts, gens))
            del ref
            return agreement
        res.section("engine_check", engine_check, deadline, 60)

    def offline():
        out = {"trace": offline_trace.describe(), "runs": []}
        for policy, sizes in ((driver.ORCA, profile.orca_batch_sizes), (driver.BASELINE, profile.baseline_batch_sizes)):
            for bs in sizes:
                if deadline.expired(90):
                    out["runs"].append({"policy": policy, "max_num_seqs": bs, "skipped": "time"})
                    continue
                driver.use_scheduler(engine, policy, bs)
                run = driver.run_trace(engine, offline_trace, f"{policy}-bs{bs}", realtime=False, max_seconds=150)
                out["runs"].append(run.summary() | {"policy": policy, "max_num_seqs": bs,
                                                    "roofline": roofline.run_bound(costs, peaks, run.records, run.wall_s)})
                res.data["offline"] = out
                res.save()
        return out
    res.section("offline", offline, deadline, 60)

    def engine_issue():
        mixed = make_trace(TraceKind.UNIFORM, profile.mixed_requests, None, seed + 1, lengths)
        driver.use_scheduler(engine, driver.ORCA, min(MAX_BATCH, profile.mixed_requests))
        together = driver.run_trace(engine, mixed, "mixed", realtime=False).summary()
        subset = dataclasses.replace(mixed, requests=mixed.requests[:profile.alone_requests])
        alone = driver.run_one_at_a_time(engine, subset, "one-at-a-time").summary()
        return {"mixed": together, "one_at_a_time": alone,
                "speedup_tokens_per_s": together["throughput_tok_s"] / alone["throughput_tok_s"]}
    res.section("engine_issue", engine_issue, deadline, 45)

    res.section("microbench", lambda: {"rows": microbench.microbench(
        engine, costs, peaks, profile.micro_input_lens, 32, profile.micro_batch_sizes, deadline=_Margin(deadline, 150))},
        deadline, 60)

    def sweep():
        runs = (res.data.get("offline") or {}).get("runs", [])
        measured = [r["throughput_req_s"] for r in runs if r.get("policy") == driver.ORCA and "throughput_req_s" in r]
        rate_base = capacity or max(measured, default=10.0)
        rates = e2e.rates_from_capacity(rate_base, profile.e2e_fractions)
        out = {"capacity_req_s": rate_base, "rates": rates, "points": []}

        def on_point(points):
            out["points"] = points
            res.data["e2e"] = out
            res.save()
        out["points"] = e2e.sweep(engine, profile.e2e_configs, rates, costs, peaks, seed=seed,
                                  point_seconds=profile.point_seconds, max_requests=profile.max_point_requests,
                                  min_requests=profile.min_point_requests,
                                  deadline=_Margin(deadline, 25), on_point=on_point, lengths=lengths)
        out["matched_latency"] = e2e.compare_at_matched_latency(out["points"])
        return out
    res.section("e2e", sweep, deadline, 40)

    res.section("padding", lambda: padding.padding_report(offline_trace, max_num_batched_tokens=settings["max_num_batched_tokens"]))
    res.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    res.save()
    print_table(res.data)
    return res.data


class _Margin:
    """A deadline that expires `margin` seconds early."""

    def __init__(self, deadline: Deadline, margin: float):
        self.deadline, self.margin = deadline, margin

    def expired(self) -> bool:
        return self.deadline.expired(self.margin)


def print_table(data: dict) -> None:
    """A short human summary of one model's results."""
    print(f"\n== {data['model']} on {data.get('device', {}).get('kind')} "
          f"({(data.get('engine') or {}).get('attention')})")
    hf = (data.get("hf") or {}).get("offline")
    for run in (data.get("offline") or {}).get("runs", []):
        if "throughput_tok_s" in run:
            print(f"offline {run['policy']:>8} bs={run['max_num_seqs']:<4} {run['throughput_tok_s']:9.0f} tok/s "
                  f"{run['throughput_req_s']:7.2f} req/s  host {1e3 * run['host_s_per_iter']:.2f} ms/it  "
                  f"device {1e3 * run['device_wait_s_per_iter']:.2f} ms/it  roofline "
                  f"{run['roofline']['achieved_fraction']:.2f}")
    if hf:
        print(f"offline       hf          {hf['tokens_per_s']:9.0f} tok/s {hf['requests_per_s']:7.2f} req/s")
    issue = data.get("engine_issue") or {}
    if "speedup_tokens_per_s" in issue:
        print(f"engine vs one-at-a-time: {issue['mixed']['throughput_tok_s']:.0f} vs "
              f"{issue['one_at_a_time']['throughput_tok_s']:.0f} tok/s (x{issue['speedup_tokens_per_s']:.1f})")
    for row in (data.get("e2e") or {}).get("matched_latency", []):
        print(f"matched latency {1e3 * row['latency_target_s_per_token']:.1f} ms/token: orca "
              f"{row['orca_req_s']:.2f} req/s vs baseline {row['baseline_req_s']:.2f} (x{row['ratio']})")
