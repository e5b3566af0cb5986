"""Probe: which device buffers of a decode step's programs move from one step to the next.

XLA replays a program's recorded CUDA graph unchanged only while every buffer it reads or writes stays
at the address it was recorded with; each moved one costs an update of the graph (~0.7 ms for
llama-1b's 249-command forward on an H200). This runs batch-1 decode steps of the engine and prints,
per program, the arguments and outputs whose device address changed between consecutive calls (the
pointer of each array, read as the programs run).

    python benchmarks/probes/step_buffers.py --model llama-1b --steps 12
"""

from __future__ import annotations

import argparse
import collections
import json

import jax

from orca_jax.bench.harness import random_model
from orca_jax.config import CacheConfig, EngineConfig, Quantization, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams


def pointers(tree) -> list:
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            try:
                out.append((leaf.unsafe_buffer_pointer(), tuple(leaf.shape), str(leaf.dtype)))
            except Exception:  # noqa: BLE001 - donated and already deleted
                out.append(("deleted", tuple(leaf.shape), str(leaf.dtype)))
        else:
            out.append(("host", getattr(leaf, "shape", None), type(leaf).__name__))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    loaded = random_model(args.model, "bfloat16")
    config = EngineConfig(model=args.model, cache=CacheConfig(num_pages=512, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), precompile=False,
                          quantization=None if args.quantization is None else Quantization(args.quantization))
    engine = Engine(config, loaded)
    compilation = engine.runner.compilation
    original = compilation.executable
    calls = collections.defaultdict(list)

    def recording(key):
        executable = original(key)

        def call(*call_args):
            before = pointers(call_args)  # arguments as passed (donated ones are read before the call)
            out = executable(*call_args)
            calls[type(key).__name__].append((before, pointers(out)))
            return out
        return call

    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    compilation.executable = recording  # a probe's patch: records what each program gets and gives
    for _ in range(args.steps):
        engine.step()
    report = {}
    for name, seen in calls.items():
        moved_args, moved_outs = collections.Counter(), collections.Counter()
        for (a0, o0), (a1, o1) in zip(seen, seen[1:]):
            for i, (x, y) in enumerate(zip(a0, a1)):
                if x[0] != y[0]:
                    moved_args[f"arg{i} {x[1]} {x[2]}" + (" host" if x[0] == "host" else "")] += 1
            for i, (x, y) in enumerate(zip(o0, o1)):
                if x[0] != y[0]:
                    moved_outs[f"out{i} {x[1]} {x[2]}"] += 1
        report[name] = {"calls": len(seen), "moved_args": dict(moved_args), "moved_outputs": dict(moved_outs)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
