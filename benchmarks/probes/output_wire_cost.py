"""What one iteration's outputs cost to cross the engine core's pipe, whole RequestOutputs against the
deltas of engine/output_wire.py, at 256 requests and output lengths 16 to 1,024 tokens (no device).

Per iteration, µs (best of --repeats): the core's side (encode + pickle) and the front end's (unpickle
+ rebuild), and the bytes sent. Each request gets one token and four characters this step; its text
holds four characters per token so far.

    PYTHONPATH=. python benchmarks/probes/output_wire_cost.py --json benchmarks/results/cpu/probes/output_wire_cost.json
"""
from __future__ import annotations

import argparse
import json
import pickle
import platform
import time

from orca_jax.engine.output_wire import OutputEncoder, Received, request_id_of
from orca_jax.outputs import RequestOutput

PROTOCOL = pickle.HIGHEST_PROTOCOL  # what multiprocessing's Connection.send uses (ForkingPickler)


def step_outputs(num_requests: int, length: int) -> list[RequestOutput]:
    return [RequestOutput(f"cmpl-{i:032x}-0", [1000 + length - 1], "abcd", list(range(1000, 1000 + length)),
                          "abcd" * length, 300, queue_seconds=0.01, num_cached_tokens=16)
            for i in range(num_requests)]


def best_us(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e6 * best


def measure(num_requests: int, length: int, repeats: int) -> dict:
    previous, outputs = step_outputs(num_requests, length - 1), step_outputs(num_requests, length)
    whole = pickle.dumps(outputs, PROTOCOL)

    def encoder_after_previous_step() -> OutputEncoder:
        encoder = OutputEncoder()
        encoder.encode_all(previous)
        return encoder

    def front_end_after_previous_step() -> dict[str, Received]:
        received = {o.request_id: Received() for o in previous}
        for row in OutputEncoder().encode_all(previous):
            received[request_id_of(row)].decode(row)
        return received

    rows = encoder_after_previous_step().encode_all(outputs)
    deltas = pickle.dumps(rows, PROTOCOL)
    # Each timed call starts from the previous step's state; building it is outside the timing.
    encoders = [encoder_after_previous_step() for _ in range(repeats)]
    fronts = [front_end_after_previous_step() for _ in range(repeats)]

    def core_deltas():
        pickle.dumps(encoders.pop().encode_all(outputs), PROTOCOL)

    def front_deltas():
        received = fronts.pop()
        for row in pickle.loads(deltas):
            received[request_id_of(row)].decode(row)

    rebuilt_ok = [received.decode(row) for received, row in zip(
        front_end_after_previous_step().values(), rows)] == outputs
    return {
        "requests": num_requests, "output_tokens": length, "rebuilt_equal": rebuilt_ok,
        "whole": {"bytes": len(whole), "core_us": best_us(lambda: pickle.dumps(outputs, PROTOCOL), repeats),
                  "front_end_us": best_us(lambda: pickle.loads(whole), repeats)},
        "deltas": {"bytes": len(deltas), "core_us": best_us(core_deltas, repeats),
                   "front_end_us": best_us(front_deltas, repeats)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(args.requests, length, args.repeats) for length in args.lengths]
    print(f"{'tokens':>7} {'whole B':>9} {'core us':>8} {'front us':>9} | {'deltas B':>9} {'core us':>8} {'front us':>9}")
    for r in rows:
        w, d = r["whole"], r["deltas"]
        print(f"{r['output_tokens']:>7} {w['bytes']:>9} {w['core_us']:>8.0f} {w['front_end_us']:>9.0f} | "
              f"{d['bytes']:>9} {d['core_us']:>8.0f} {d['front_end_us']:>9.0f}  equal={r['rebuilt_equal']}")
    if args.json:
        meta = {"command": "benchmarks/probes/output_wire_cost.py", "machine": platform.processor() or platform.machine(),
                "python": platform.python_version(), "repeats": args.repeats}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
