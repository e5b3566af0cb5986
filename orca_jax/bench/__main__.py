"""`python -m orca_jax.bench {suite,hf,cpu,padding,memory-plan,parallel,core,core-report,report,kernels,iteration,serve,http-cost,policies,structured}`:
see each subcommand's --help."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m orca_jax.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    suite = sub.add_parser("suite", help="one model's GPU suite (offline, microbench, e2e, roofline)")
    suite.add_argument("--model", required=True)
    suite.add_argument("--profile", default="full", choices=["full", "small", "lowrate", "quick", "smoke", "plumbing"])
    suite.add_argument("--out", required=True, help="directory for <model>.json and <model>_hf.json")
    suite.add_argument("--budget-s", type=float, default=500.0, help="wall-clock budget; sections past it skip")
    suite.add_argument("--seed", type=int, default=0)
    suite.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    suite.add_argument("--hf-timeout-s", type=float, default=200.0)
    suite.add_argument("--sections", default=None, help="comma list, e.g. e2e (peaks, engine always run)")
    suite.add_argument("--e2e-configs", default=None, help="e.g. baseline:32,orca:128")
    suite.add_argument("--capacity", type=float, default=None, help="req/s the e2e rates are fractions of")
    suite.add_argument("--tag", default=None, help="write <model>_<tag>.json (merged by the report)")

    hf = sub.add_parser("hf", help="the transformers continuous-batching peer (run in its own process)")
    hf.add_argument("--model", required=True)
    hf.add_argument("--num-requests", type=int, default=512)
    hf.add_argument("--seed", type=int, default=0)
    hf.add_argument("--device", default="cuda")
    hf.add_argument("--no-micro", action="store_true")
    hf.add_argument("--out-file", required=True)

    cpu = sub.add_parser("cpu", help="the engine issue's numbers on CPU (SmolLM2-135M, real weights)")
    cpu.add_argument("--out", default="benchmarks/results/cpu")
    cpu.add_argument("--num-requests", type=int, default=64)
    cpu.add_argument("--alone", type=int, default=8)

    pad = sub.add_parser("padding", help="padding waste of the paper's trace (host arithmetic only)")
    pad.add_argument("--num-requests", type=int, default=512)
    pad.add_argument("--seed", type=int, default=0)
    pad.add_argument("--out", default=None, help="write padding.json here")

    mem = sub.add_parser("memory-plan", help="per-GPU weights, KV bytes and KV pool of a (tp, pp) mesh (arithmetic)")
    mem.add_argument("--model", required=True)
    mem.add_argument("--tp", type=int, default=1)
    mem.add_argument("--pp", type=int, default=1)
    mem.add_argument("--gpu-gib", type=float, required=True, help="memory of one GPU")
    mem.add_argument("--mem-fraction", type=float, default=0.95,
                     help="the XLA_PYTHON_CLIENT_MEM_FRACTION the run sets (jax's default is 0.75)")
    mem.add_argument("--page-size", type=int, default=16)
    mem.add_argument("--out", default=None, help="write the plan as JSON to this file")
    par = sub.add_parser("parallel", help="one model at (tp, pp) meshes: trace throughput, pipelined vs "
                         "one batch in flight, decode time per iteration vs the weight-read bound")
    par.add_argument("--model", default="llama-8b")
    par.add_argument("--out", required=True)
    par.add_argument("--meshes", default="1x1,2x1,1x2", help="TPxPP,...")
    par.add_argument("--num-requests", type=int, default=256)
    par.add_argument("--kv-gib", type=float, default=40.0, help="KV pool of each mesh (all its devices)")
    par.add_argument("--seed", type=int, default=0)

    report = sub.add_parser("report", help="plots and summary.md from a results directory")
    report.add_argument("results_dir")
    core_report = sub.add_parser("core-report", help="table (core.md) and figure (core.png) from `core` results")
    core_report.add_argument("results_dir")

    serve = sub.add_parser("serve", help="load-test any OpenAI-compatible server over HTTP (TTFT, TPOT, ITL)")
    from orca_jax.bench import serve_client
    serve_client.add_arguments(serve)

    http_cost = sub.add_parser("http-cost", help="the HTTP server's tokens/s and CPU per streamed token on CPU, "
                               "with a synthetic engine (no model)")
    http_cost.add_argument("--num-requests", type=int, default=512)
    http_cost.add_argument("--seed", type=int, default=0)
    http_cost.add_argument("--max-batch-size", type=int, default=128)
    http_cost.add_argument("--max-tokens", type=int, default=None, help="every request's (default: the trace's)")
    http_cost.add_argument("--host-ms", type=float, default=0.0, help="GIL-held CPU per engine step")
    http_cost.add_argument("--device-ms", type=float, default=0.0, help="GIL-free wait per engine step")
    http_cost.add_argument("--profile", default=None, help="cProfile the event-loop thread into this file")
    http_cost.add_argument("--out", default=None, help="write the result as JSON to this file")

    core = sub.add_parser("core", help="engine core: cold start, decode vs weight-read bound, traces vs roofline, "
                                       "async scheduling on/off, transformers peer")
    core_start = sub.add_parser("core-start", help="(child of `core`) build one engine, print its start-up timing")
    for p in (core, core_start):
        p.add_argument("--model", required=True)
        p.add_argument("--max-num-seqs", type=int, default=128)
        p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    core.add_argument("--num-requests", type=int, default=512)
    core.add_argument("--out", required=True, help="directory for <model>_core.json")
    core.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    core.add_argument("--sections", default="cold_start,engine,http,hf",
                      help="comma list of cold_start, http, hf, engine (or async, sync: one of its two runs)")
    core.add_argument("--cache-dir", default=None, help="compilation cache every section shares (default: a fresh one)")
    core.add_argument("--profile", action="store_true",
                      help="also a jax profiler trace of 30 uniform-trace iterations per engine section")
    core.add_argument("--profile-skip", type=int, default=3,
                      help="iterations run before the profiled ones (the first are prefill-heavy)")
    core_start.add_argument("--cache-dir", required=True)

    structured = sub.add_parser("structured", help="the uniform trace greedy and with a JSON schema on every request: "
                                "tokens/s ratio and host mask time per step")
    structured.add_argument("--model", required=True)
    structured.add_argument("--max-num-seqs", type=int, default=128)
    structured.add_argument("--max-num-batched-tokens", type=int, default=2048)
    structured.add_argument("--num-requests", type=int, default=512)
    structured.add_argument("--dtype", default="bfloat16")
    structured.add_argument("--variants", default="greedy,json_schema", help="comma list; the first is the baseline")
    structured.add_argument("--out", required=True, help="directory for <model>_structured.json")
    structured.add_argument("--cache-dir", default=None, help="compilation cache (default: a fresh one)")

    policies = sub.add_parser("policies", help="fcfs/sjf/edf/das on TCB's workload (utility, deadline hits)")
    policies.add_argument("--out", default="benchmarks/results/cpu")
    policies.add_argument("--num-requests", type=int, default=160, help="per run at batch 16 (x4 at 64)")
    policies.add_argument("--seed", type=int, default=0)

    # Its own parser takes the rest of the line (see the dispatch below); listed here for --help.
    sub.add_parser("kernels", help="ragged attention kernel vs the jnp reference on a GPU")

    iteration = sub.add_parser("iteration", help="one llama-8b engine iteration at batch 64: Pallas vs jnp")
    iteration.add_argument("out_file")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kernels"]:
        from orca_jax.bench.kernels import main as kernels_main
        kernels_main(argv[1:])
        return
    args = parser.parse_args(argv)
    if args.command == "suite":
        from orca_jax.bench.suite import run_suite
        configs = None if not args.e2e_configs else tuple(
            (policy, int(bs)) for policy, bs in (item.split(":") for item in args.e2e_configs.split(",")))
        run_suite(args.model, args.profile, args.out, args.budget_s, args.seed, not args.no_hf, args.hf_timeout_s,
                  sections=None if args.sections is None else set(args.sections.split(",")),
                  e2e_configs=configs, capacity=args.capacity, tag=args.tag)
    elif args.command == "hf":
        from orca_jax.bench.peer_hf import run_peer
        from orca_jax.bench.traces import TraceKind, make_trace
        from orca_jax.models.presets import PRESETS
        trace = make_trace(TraceKind.UNIFORM, args.num_requests, None, args.seed)
        micro = {} if not args.no_micro else {"micro_batch_sizes": ()}
        result = run_peer(PRESETS[args.model], trace, device=args.device, out_path=args.out_file, **micro)
        offline = result.get("offline", {})
        print(f"hf {args.model}: {offline.get('tokens_per_s', float('nan')):.0f} tok/s offline")
    elif args.command == "cpu":
        from orca_jax.bench.cpu import run_cpu
        run_cpu(args.out, num_requests=args.num_requests, alone=args.alone)
    elif args.command == "padding":
        from orca_jax.bench.padding import padding_report
        from orca_jax.bench.traces import TraceKind, make_trace
        result = padding_report(make_trace(TraceKind.UNIFORM, args.num_requests, None, args.seed))
        for row in result["rows"]:
            print(row)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "padding.json"), "w") as f:
                json.dump(result, f, indent=1)
    elif args.command in ("core", "core-start"):
        from orca_jax.bench.core import CoreSetup, run_core, start_probe
        setup = CoreSetup(args.model, args.max_num_seqs, args.max_num_batched_tokens,
                          getattr(args, "num_requests", 512))
        if args.command == "core-start":
            print(json.dumps(start_probe(setup, args.cache_dir)))
        else:
            sections = set(args.sections.split(",")) - ({"hf"} if args.no_hf else set())
            run_core(setup, args.out, sections=sections, cache_dir=args.cache_dir, profile=args.profile,
                     profile_skip=args.profile_skip)
    elif args.command == "structured":
        from orca_jax.bench.core import CoreSetup
        from orca_jax.bench.structured import run_structured
        setup = CoreSetup(args.model, args.max_num_seqs, args.max_num_batched_tokens, args.num_requests,
                          dtype=args.dtype)
        result = run_structured(setup, args.out, tuple(args.variants.split(",")), args.cache_dir)
        print(json.dumps({name: {k: v["runs"][-1][k] for k in v["runs"][-1] if k.startswith(("over_", "tokens_per_s",
                                                                                              "mask_ms"))}
                          for name, v in result["variants"].items()}, indent=1))
    elif args.command == "iteration":
        from orca_jax.bench.iteration import main as iteration_main
        iteration_main(args.out_file)
    elif args.command == "memory-plan":
        from orca_jax.bench.memory_plan import GIB, memory_plan
        from orca_jax.models.presets import get_preset
        plan = memory_plan(get_preset(args.model), args.tp, args.pp, int(args.gpu_gib * GIB), args.mem_fraction,
                           page_size=args.page_size)
        result = {"model": args.model, "gpu_gib": args.gpu_gib, **plan.as_dict()}
        print(json.dumps(result, indent=1))
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    elif args.command == "parallel":
        from orca_jax.bench.parallel import run_parallel
        meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
        result = run_parallel(args.model, args.out, meshes, args.num_requests, args.seed, kv_gib=args.kv_gib)
        for row in result["meshes"]:
            print({k: v for k, v in row.items() if not k.startswith("trace")})
    elif args.command == "report":
        from orca_jax.bench.report import write_report
        print(write_report(args.results_dir))
    elif args.command == "core-report":
        from orca_jax.bench.core_report import main as core_report_main
        core_report_main(args.results_dir)
    elif args.command == "serve":
        serve_client.main(args)
    elif args.command == "http-cost":
        from orca_jax.bench.http_cost import print_profile, run_http_cost
        result = run_http_cost(args.num_requests, seed=args.seed, max_num_seqs=args.max_num_seqs,
                               max_tokens=args.max_tokens, host_ms=args.host_ms, device_ms=args.device_ms, profile_path=args.profile)
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        if args.profile:
            print_profile(args.profile)
    elif args.command == "policies":
        from orca_jax.bench.policies import run_policies
        run_policies(args.out, num_requests=args.num_requests, seed=args.seed)


if __name__ == "__main__":
    main()
