"""What one request's stop strings cost everyone else: a victim request's inter-token gaps (engine
steps, each gives it one token) while n hostile requests run beside it, each with K stop strings that
never match, against the same with one stop string each.

    PYTHONPATH=. python benchmarks/probes/stop_strings_cost.py --num-stop 100000 --n 64

The engine's limits on stop strings are raised to K for the run (SamplingConfig.max_stop_strings and
max_stop_chars), so the cost measured is the matching's, not a refusal's.
"""
import argparse
import dataclasses
import json
import random
import statistics
import time

from orca_jax.config import CacheConfig, EngineConfig, SamplingConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams


def stop_list(count: int, seed: int = 0) -> tuple[str, ...]:
    """count distinct 9-character strings the tiny model's text never holds (each has a "\x01")."""
    rng = random.Random(seed)
    return tuple(dict.fromkeys("\x01" + "".join(rng.choice("abcdefghij") for _ in range(8))
                               for _ in range(count)))


def victim_gaps(engine: Engine, hostile_stop: tuple[str, ...], n: int, max_tokens: int) -> list[float]:
    """Seconds between the victim's tokens (one engine step each) with n hostile requests beside it."""
    for i in range(n):
        engine.add_request([5 + i % 50, 6, 7], SamplingParams(max_tokens=max_tokens + 4, ignore_eos=True,
                                                              stop=hostile_stop), request_id=f"hostile-{i}")
    engine.add_request([9, 10, 11], SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id="victim")
    gaps, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "victim" and out.new_token_ids:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-stop", type=int, default=100_000)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    many = stop_list(args.num_stop)
    limits = {}
    if "max_stop_strings" in {f.name for f in dataclasses.fields(SamplingConfig)}:
        limits = {"max_stop_strings": len(many), "max_stop_chars": sum(map(len, many))}
    engine = Engine(EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=4, num_pages=1024),
                                 scheduler=SchedulerConfig(max_num_seqs=args.n + 1, max_num_batched_tokens=256),
                                 sampling=SamplingConfig(**limits), precompile=False))
    victim_gaps(engine, many[:1], args.n, 4)  # compile what the runs meet
    rows = {}
    for name, stop in (("control_1_stop", many[:1]), (f"hostile_{len(many)}_stops", many)):
        start = time.perf_counter()
        gaps = victim_gaps(engine, stop, args.n, args.max_tokens)
        rows[name] = {"median_gap_ms": 1e3 * statistics.median(gaps), "max_gap_ms": 1e3 * max(gaps),
                      "seconds": time.perf_counter() - start}
    control, hostile = rows.values()
    rows["median_gap_ratio"] = hostile["median_gap_ms"] / control["median_gap_ms"]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
