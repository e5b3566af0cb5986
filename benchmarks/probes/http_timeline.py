"""Where an HTTP replay of the uniform trace loses time against the same trace in process.

`python benchmarks/probes/http_timeline.py MODEL OUT SPEC[,SPEC...]`, from the repository root on a
GPU machine. Each SPEC starts one server (traced_serve.py, the core bench's flags) and replays the
512-request trace through it with `bench serve`'s client: "aio2" replays twice; "freeze;switch=0.0005:aio2"
first freezes the server's heap after its precompile and sets a 0.5 ms GIL switch interval. Then the
trace runs twice in process on an engine of the same shape. OUT/http_timeline_MODEL.json holds each
replay's throughput and time to first token, and the server's timeline of its first 1.2 s (submits on
the event loop, adds and steps on the engine thread, dispatch timings, garbage collections).
"""

import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())

from orca_jax.bench import serve_client  # noqa: E402
from orca_jax.bench.core import CoreSetup, _run_trace, engine_config, random_model  # noqa: E402
from orca_jax.bench.http_replay import _compiled_programs, _wait_ready, serve_flags  # noqa: E402
from orca_jax.bench.traces import TraceKind, make_trace  # noqa: E402
from orca_jax.engine import Engine  # noqa: E402
from orca_jax.models.presets import PRESETS  # noqa: E402

PORT = 8765
BASE_URL = f"http://127.0.0.1:{PORT}"
TIMELINE_S = 1.2


def replay(setup: CoreSetup) -> tuple[dict, float]:
    config = serve_client.ServeBenchConfig(base_url=BASE_URL, model=setup.model, num_requests=setup.num_requests,
                                           trace=TraceKind.UNIFORM, lengths=setup.lengths,
                                           vocab_size=PRESETS[setup.model].vocab_size, timeout_s=600)
    began = time.perf_counter()
    summary, records = asyncio.run(serve_client.run(config, progress=False))
    firsts = sorted(r.chunk_s[0] for r in records if r.chunk_s)
    return {"tok_s": summary["output_throughput"], "duration_s": summary["duration_s"], "failed": summary["failed"],
            "min_ttft_ms": summary["ttft_ms"]["min"], "p50_ttft_ms": summary["ttft_ms"]["p50"],
            "first_chunk_s": [firsts[0], firsts[127], firsts[-1]], "tpot_ms": summary["tpot_ms"]["mean"]}, began


def timeline(events: list, began: float, duration_s: float) -> dict:
    """The server's events of one replay, in seconds after the client began."""
    at = lambda kind, until: [e for e in events if e[0] == kind and 0 <= e[1] - began < until]
    submits, adds = at("submit", duration_s), at("add", duration_s)
    pick = lambda rows: [round(rows[i][1] - began, 4) for i in (0, 127, 255, len(rows) - 1)] if len(rows) > 255 else []
    early = [e for e in events if e[0] in ("step_begin", "step_end", "dispatch", "update", "gc")
             and 0 <= e[1] - began < TIMELINE_S]
    return {"submits": pick(submits), "adds": pick(adds),
            "timeline": [[e[0], round(e[1] - began, 4), *e[2:]] for e in early],
            "gc": [[round(e[1] - began, 4), *e[2:]] for e in at("gc", duration_s + 0.5)]}


def serve_and_replay(setup: CoreSetup, spec: str, cache_dir: str, out_dir: str, index: int) -> dict:
    env, options = dict(os.environ), {}
    if ":" in spec:
        settings, spec = spec.split(":")
        for setting in settings.split(";"):
            if setting.startswith("switch="):
                options["switch"] = env["SWITCH"] = setting[len("switch="):]
            elif setting == "freeze":
                options["gc_freeze"] = env["GC_FREEZE"] = "1"
    env["TRACE_OUT"] = trace_path = os.path.join(out_dir, f"server_events_{index}.json")
    cmd = [sys.executable, "benchmarks/probes/traced_serve.py", *serve_flags(setup, PORT, cache_dir)]
    entry = {"options": options, "replays": spec, "runs": []}
    with open(os.path.join(out_dir, "server.log"), "a") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            entry["ready_s"] = _wait_ready(BASE_URL, server, 600)
            entry["programs_at_ready"] = _compiled_programs(BASE_URL)
            began_at = []
            for _ in range(int(spec.removeprefix("aio"))):
                run, began = replay(setup)
                entry["runs"].append(run)
                began_at.append(began)
                print(run, flush=True)
            entry["programs_after"] = _compiled_programs(BASE_URL)
        finally:
            server.terminate()
            server.wait(60)
    with open(trace_path) as f:
        events = json.load(f)
    os.remove(trace_path)
    for run, began in zip(entry["runs"], began_at):
        run.update(timeline(events, began, run["duration_s"]))
    return entry


def main() -> None:
    model, out_dir, specs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    setup, cache_dir = CoreSetup(model=model), "/tmp/orca_probe_cache"
    result = {"model": model, "specs": specs, "servers": []}
    path = os.path.join(out_dir, f"http_timeline_{model}.json")
    for index, spec in enumerate(specs):
        result["servers"].append(serve_and_replay(setup, spec, cache_dir, out_dir, index))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    engine = Engine(engine_config(setup, compilation_cache_dir=cache_dir), random_model(model, setup.dtype))
    trace = make_trace(TraceKind.UNIFORM, setup.num_requests, None, 0, setup.lengths)
    result["in_process"] = [{k: v for k, v in _run_trace(engine, trace).items() if k != "host_split"} for _ in range(2)]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
