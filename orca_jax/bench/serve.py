"""`bench serve`: load-test any OpenAI-compatible server over HTTP (ours, vLLM, ...); flags as vLLM's.

Streamed requests (serve_client.py) from a dataset or a JSONL of prompts, at --request-rate (Gamma
arrivals of --burstiness; inf: all at once); requests/s, output tokens/s, TTFT, TPOT, inter-token
latency, and goodput under --goodput SLOs. --launch first starts `python -m orca_jax.serve` with the
engine flags given (the rest are what serve picks for the model and device, so the numbers are what a
user of serve gets), waits until /health says every program is compiled, and checks that serving
compiled nothing more. --compare-in-process then runs the same requests through the same engine (serve's
settings, resolved for this device) in this process (after the server has exited, so each has the GPU
to itself), twice, and reports the last HTTP run's output tokens/s over the last in-process run's.

docs/benchmarks.md's HTTP replay (the ORCA trace, twice through the server, against in-process):
  python -m orca_jax.bench serve --model llama-8b --launch --compare-in-process --num-runs 2 \
      --ignore-eos --result-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import math
import os
import time

from orca_jax.bench import serve_client
from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, lengths_from_args, make_trace
from orca_jax.bench.driver import run_trace
from orca_jax.bench.harness import (Results, add_engine_arguments, add_result_arguments, build_engine,
                                    compiled_programs, device_info, fill_batch_defaults, launched_server, serve_flags)
from orca_jax.engine.defaults import UsageContext
from orca_jax.bench.serve_client import CUSTOM, Endpoint, PromptFormat, ServeBenchConfig
from orca_jax.bench.serve_stats import Slo, format_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, server_defaults=True)  # --model is also the model name requests carry
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM, DatasetName.HOMOGENEOUS,
                                                      DatasetName.SHAREGPT_LIKE))
    parser.add_argument("--dataset-path", default=None, help=f'--dataset-name {CUSTOM}: a JSONL of '
                        '{"prompt": ...} or {"messages": [...]} lines, each optionally with "max_tokens"')
    parser.add_argument("--custom-output-len", type=int, default=None,
                        help=f"{CUSTOM}: max_tokens of lines without one (default: send none)")
    parser.add_argument("--base-url", default=None, help="the server (default: the launched one)")
    parser.add_argument("--launch", action="store_true", help="start `python -m orca_jax.serve` with the engine flags")
    parser.add_argument("--port", type=int, default=8765, help="of the launched server")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                        help="launch the server with its engine core in its own process (serve --engine-process)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="launch the server with this many engine replicas (serve --data-parallel-size)")
    parser.add_argument("--api-server-count", type=int, default=None,
                        help="launch the server with this many API server processes (default: serve's)")
    parser.add_argument("--endpoint", choices=[e.value for e in Endpoint], default=Endpoint.COMPLETIONS.value)
    parser.add_argument("--prompt-format", choices=[p.value for p in PromptFormat], default=None,
                        help="dataset prompts as token ids (completions' default) or words (chat's)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="id prompts stay below this (default: the preset's vocabulary, else 256)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; inf: evenly spaced")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="every request generates its max_tokens")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--num-runs", type=int, default=1, help="replays of the same requests")
    parser.add_argument("--compare-in-process", action="store_true",
                        help="also run the requests through the same engine in process (needs a preset model)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--api-key", default=None, help="or $OPENAI_API_KEY")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_result_arguments(parser)


def _vocab_size(args: argparse.Namespace) -> int:
    if args.vocab_size is not None:
        return args.vocab_size
    from orca_jax.models.presets import PRESETS

    return PRESETS[args.model].vocab_size if args.model in PRESETS else 256


def config_from_args(args: argparse.Namespace, base_url: str) -> ServeBenchConfig:
    endpoint = Endpoint(args.endpoint)
    custom = args.dataset_name == CUSTOM
    default_format = PromptFormat.TEXT if endpoint is Endpoint.CHAT else PromptFormat.IDS
    return ServeBenchConfig(
        base_url=base_url, model=args.model, num_requests=args.num_prompts,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate, burstiness=args.burstiness,
        dataset=None if custom else DatasetName(args.dataset_name), lengths=lengths_from_args(args),
        dataset_path=args.dataset_path if custom else None, endpoint=endpoint,
        prompt_format=PromptFormat(args.prompt_format) if args.prompt_format else default_format,
        vocab_size=_vocab_size(args), custom_output_len=args.custom_output_len, ignore_eos=args.ignore_eos,
        max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout_s,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), slo=Slo.parse(args.goodput))


# Our server's engine counters on /metrics (server/metrics.py; with data-parallel replicas, their total),
# as a run's summary names them.
ENGINE_COUNTERS = {"iterations": "orca_jax:iterations_total", "generated_tokens": "orca_jax:generation_tokens_total",
                   "host_s": "orca_jax:host_seconds_total", "device_wait_s": "orca_jax:device_wait_seconds_total",
                   "batched_requests": "orca_jax:batched_requests_total"}


def engine_counters(base_url: str) -> dict[str, float] | None:
    """The server's engine counters now; None where it exposes none (not our server, or no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).raise_for_status().text
    except httpx.HTTPError:
        return None
    names = {name: key for key, name in ENGINE_COUNTERS.items()}
    values = {names[sample.name]: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples
              if sample.name in names and sample.labels.get("replica", "all") == "all"}
    return values if len(values) == len(names) else None


def per_iteration(iterations: int, wall_s: float, host_s: float, device_wait_s: float,
                  mean_batch_size: float) -> dict[str, float]:
    """An engine's run as bench serve sets HTTP beside in process: its iterations and their mean times."""
    per = 1e3 / max(iterations, 1)
    return {"iterations": int(iterations), "mean_batch_size": mean_batch_size, "ms_per_iteration": wall_s * per,
            "host_ms_per_iteration": host_s * per, "device_wait_ms_per_iteration": device_wait_s * per}


def engine_side(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict[str, float]:
    """What the engine did during one run, from its counters (the HTTP run's wall includes its ramp and drain)."""
    delta = {key: after[key] - before[key] for key in ENGINE_COUNTERS}
    return {"generated_tokens": int(delta["generated_tokens"]),
            **per_iteration(delta["iterations"], duration_s, delta["host_s"], delta["device_wait_s"],
                            delta["batched_requests"] / max(delta["iterations"], 1))}


def _replays(config: ServeBenchConfig, args: argparse.Namespace) -> tuple[list[dict], list]:
    runs, records = [], []
    for _ in range(args.num_runs):
        before = engine_counters(config.base_url)
        cpu = time.process_time()
        summary, records = asyncio.run(serve_client.run(config, progress=not args.disable_tqdm))
        # The load generator's own CPU: near the run's duration, it (one process) may be what limits it.
        summary["client_cpu_s"] = time.process_time() - cpu
        after = engine_counters(config.base_url) if before is not None else None
        if after is not None:
            summary["engine"] = engine_side(before, after, summary["duration_s"])
        print(format_summary(summary), flush=True)
        runs.append(summary)
    return runs, serve_client.records_json(records)


def resolve_server_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with what serve picks where they leave it open (the batch for the model and this process's
    first device, serve's scheduling): the engine a launched server ran. Starts jax."""
    from orca_jax.config import SchedulerConfig
    from orca_jax.engine.defaults import LARGE_MODEL_PARAMS, SERVER_SCHEDULING, UsageContext, batch_defaults
    from orca_jax.models.presets import PRESETS

    resolved = copy.copy(args)
    if args.max_num_seqs is None or args.max_num_batched_tokens is None:
        batch = batch_defaults(UsageContext.SERVER,
                               PRESETS[args.model].num_params if args.model in PRESETS else LARGE_MODEL_PARAMS)
        resolved.max_num_seqs = args.max_num_seqs or batch.max_num_seqs
        resolved.max_num_batched_tokens = args.max_num_batched_tokens or batch.max_num_batched_tokens
    scheduler = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    resolved.max_waiting = args.max_waiting or scheduler["max_waiting"]
    resolved.scheduling_policy = args.scheduling_policy or SERVER_SCHEDULING.policy.value
    resolved.kv_allocation = args.kv_allocation or SERVER_SCHEDULING.kv_allocation.value
    return resolved


def in_process(args: argparse.Namespace) -> list[dict]:
    """The same requests (dataset, arrival times, EOS handling) through the same engine, twice."""
    fill_batch_defaults(args, UsageContext.SERVER)  # the launched server's own defaults where the flags left them
    engine = build_engine(args)
    rate = None if math.isinf(args.request_rate) else args.request_rate
    trace = make_trace(args.dataset_name, args.num_prompts, rate, args.seed, lengths_from_args(args), args.burstiness)
    return [run_trace(engine, trace, realtime=rate is not None, ignore_eos=args.ignore_eos).summary() for _ in range(2)]


def run(args: argparse.Namespace) -> Results:
    if not args.launch and not args.base_url:
        raise SystemExit("bench serve: give --base-url, or --launch")
    if args.dataset_name == CUSTOM and (not args.dataset_path or args.compare_in_process):
        raise SystemExit(f"bench serve: --dataset-name {CUSTOM} needs --dataset-path, and runs over HTTP only")
    local = args.launch or args.compare_in_process
    # jax starts (and takes the GPU) only once any launched server has exited.
    results = Results("serve", args, args.model, device={"device": None, "platform": "client"})
    if args.launch:
        log = os.path.join(args.result_dir, f"{args.model}_server.log") if args.result_dir else None
        flags = (serve_flags(args, args.port) + (["--engine-process"] if args.engine_process else [])
                 + (["--data-parallel-size", str(args.data_parallel_size)] if args.data_parallel_size > 1 else [])
                 + (["--api-server-count", str(args.api_server_count)] if args.api_server_count else []))
        with launched_server(flags, args.port, log, args.timeout_s) as server:
            config = config_from_args(args, server["base_url"])
            server["programs_at_ready"] = compiled_programs(server["base_url"])
            results.section("server", server)
            runs, records = _replays(config, args)
            server["programs_after"] = compiled_programs(server["base_url"])
    else:
        config = config_from_args(args, args.base_url)
        runs, records = _replays(config, args)
    results["config"] = {k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"}
    results.section("runs", runs)
    results.section("requests", records)
    if local:
        results.update(device_info())
    if args.compare_in_process:
        resolved = resolve_server_defaults(args)
        results.section("in_process_engine", {key: getattr(resolved, key) for key in (
            "max_num_seqs", "max_num_batched_tokens", "max_waiting", "scheduling_policy", "kv_allocation")})
        local_runs = in_process(resolved)
        results.section("in_process", local_runs)
        results.section("http_over_in_process", runs[-1]["output_throughput"] / local_runs[-1]["tokens_per_s"])
        print(f"HTTP / in-process: {results['http_over_in_process']:.3f} ({runs[-1]['output_throughput']:,.0f} vs "
              f"{local_runs[-1]['tokens_per_s']:,.0f} tok/s)")
        if "engine" in runs[-1]:  # where the gap is: the engine's iterations over HTTP against in process
            last = local_runs[-1]
            http, local = runs[-1]["engine"], per_iteration(last["iterations"], last["wall_s"], last["host_s"],
                                                            last["device_wait_s"], last["mean_batch_size"])
            print("engine, HTTP vs in process: " + ", ".join(
                f"{key} {http[key]:,.2f} vs {local[key]:,.2f}" for key in local))
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    rows = [{"run": f"HTTP {i + 1}", "completed": r["completed"], "failed": r["failed"],
             "output tok/s": r["output_throughput"], "req/s": r["request_throughput"],
             "TTFT p50 ms": r["ttft_ms"].get("p50"), "TPOT p50 ms": r["tpot_ms"].get("p50"),
             "ITL p99 ms": r["itl_ms"].get("p99"), "goodput req/s": r["goodput"]}
            for i, r in enumerate(result.get("runs", []))]
    rows += [{"run": f"in process {i + 1}", "completed": r.get("num_requests"), "output tok/s": r["tokens_per_s"],
              "req/s": r.get("requests_per_s")} for i, r in enumerate(result.get("in_process", []))]
    server = result.get("server") or {}
    if result.get("http_over_in_process") is not None or server:
        rows.append({"run": "HTTP / in process", "output tok/s": result.get("http_over_in_process"),
                     "completed": f"programs {server.get('programs_at_ready')} at ready, "
                                  f"{server.get('programs_after')} after" if server else None})
    return {"runs": rows}
