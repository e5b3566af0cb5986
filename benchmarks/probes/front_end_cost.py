"""The HTTP front end's cost per streamed token, with an engine core that costs (almost) nothing.

The server's front end (`serve --engine-process`: the event loop, the pipe's reader thread, FastAPI,
the SSE chunks) is one Python process; its CPU time per streamed token bounds the tokens/s any
model can be served at over HTTP, whatever the GPU does. This probe runs the real front end
(ProcessEngine + create_app + uvicorn, in this process) over a real engine core process whose
engine is `InstantEngine`: each step gives every live request one token, after `--step-ms` of sleep
(a device's iteration), with no model. A client in a child process (bench serve's aiohttp client)
streams `--num-requests` requests of each of `--output-lens` tokens, all at once. Reported: tokens/s
the client received, and this process's CPU time per request and per token (its threads together:
event loop and reader); 1 token per request is about the per-request cost alone.

    PYTHONPATH=. python benchmarks/probes/front_end_cost.py --num-requests 256 --output-lens 1,16,256 \
        --json benchmarks/results/cpu/probes/front_end_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import itertools
import json
import pstats
import subprocess
import sys
import time

from orca_jax.outputs import RequestOutput


class InstantEngine:
    """An Engine's face for the core's loop, without a model: config, tokenizer and stats are a real tiny
    engine's; each step appends one token (a letter, one character) to every live request."""

    def __init__(self, engine, step_seconds: float):
        self._engine = engine
        self._step_seconds = step_seconds
        self._live: dict[str, list] = {}  # request id -> [num_prompt_tokens, max_tokens, ids, text]
        self._iterations = 0

    def __getattr__(self, name):  # config, model_config, tokenizer, grammar_compiler, list_loras, ...
        return getattr(self._engine, name)

    def add_request(self, prompt_token_ids, sampling, *, request_id, **_) -> None:
        self._live[request_id] = [len(prompt_token_ids), sampling.max_tokens or 16, [], ""]

    def abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._live)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def stats(self):
        stats = self._engine.stats()
        stats.iterations = self._iterations
        stats.num_running = len(self._live)
        return stats

    def step(self) -> list[RequestOutput]:
        if self._step_seconds:
            time.sleep(self._step_seconds)
        self._iterations += 1
        outputs = []
        for request_id, live in list(self._live.items()):
            num_prompt, max_tokens, ids, text = live
            token = 97 + len(ids) % 26  # 'a'..'z' in the byte tokenizer
            ids.append(token)
            live[3] = text = text + chr(token)
            finished = len(ids) >= max_tokens
            outputs.append(RequestOutput(request_id, [token], chr(token), list(ids), text, num_prompt,
                                         finished=finished, finish_reason="length" if finished else None))
            if finished:
                del self._live[request_id]
        return outputs


def build_instant(step_seconds: float, max_num_seqs: int) -> InstantEngine:
    """Runs in the engine core process (picklable through functools.partial)."""
    from tests.helpers.engines import tiny_engine

    return InstantEngine(tiny_engine(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(64, max_num_seqs), num_pages=64), step_seconds)


def run_client(url: str, num_requests: int, output_len: int) -> None:
    """The child process: stream every request at once; print bench serve's summary as JSON."""
    from orca_jax.bench.datasets import DatasetName, LengthSpec
    from orca_jax.bench.serve_client import ServeBenchConfig, run

    config = ServeBenchConfig(base_url=url, model="tiny-llama", num_requests=num_requests,
                              dataset=DatasetName.UNIFORM,
                              lengths=LengthSpec(prompt_range=(8, 8), gen_range=(output_len, output_len)),
                              ignore_eos=True)
    summary, _ = asyncio.run(run(config, progress=False))
    print(json.dumps(summary))


def measure(args: argparse.Namespace) -> dict:
    from orca_jax.server.app import create_app
    from orca_jax.server.in_thread import served_in_thread
    from orca_jax.server.process_engine import ProcessEngine

    engine = ProcessEngine(functools.partial(build_instant, args.step_ms / 1000, args.num_requests))
    # The event loop thread's own CPU time: wall time would charge it whatever else ran meanwhile.
    profiler = cProfile.Profile(time.thread_time) if args.profile else None

    def wrap_run(run, **kwargs):
        return profiler.runcall(run, **kwargs) if profiler else run(**kwargs)

    rows = []
    with served_in_thread(create_app(engine), wrap_run=wrap_run) as served:
        for output_len, round_index in itertools.product(args.output_lens, range(args.rounds)):
            cpu_before, wall_before = time.process_time(), time.perf_counter()
            iterations_before = engine.latest_stats.iterations
            client = subprocess.run([sys.executable, __file__, "--client", served.url, "--num-requests",
                                     str(args.num_requests), "--output-lens", str(output_len)],
                                    capture_output=True, text=True, check=True)
            cpu, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
            iterations = engine.latest_stats.iterations - iterations_before
            summary = json.loads(client.stdout.strip().splitlines()[-1])
            tokens = summary["total_output_tokens"]
            rows.append({"output_len": output_len, "round": round_index, "output_tokens": tokens,
                         "client_wall_s": wall, "tok_per_s": summary["output_throughput"], "front_end_cpu_s": cpu,
                         "front_end_cpu_us_per_request": 1e6 * cpu / args.num_requests,
                         "front_end_cpu_us_per_token": 1e6 * cpu / tokens, "core_iterations": iterations,
                         "wall_ms_per_iteration": 1e3 * wall / max(iterations, 1),
                         "failed": summary.get("failed", 0)})
            print(json.dumps(rows[-1]), flush=True)
    result = {"args": vars(args), "rounds": rows}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        result["profile_event_loop_tottime"] = text.getvalue()
        print(text.getvalue())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-lens", type=lambda text: [int(n) for n in text.split(",")], default=[1, 16, 256])
    parser.add_argument("--step-ms", type=float, default=5.0, help="the fake device's time per iteration")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the event loop's thread")
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    if args.client:
        run_client(args.client, args.num_requests, args.output_lens[0])
        return
    result = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
