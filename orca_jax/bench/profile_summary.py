"""What a jax profiler trace says, in a few numbers: where device time goes and how busy each stream is.

`summarize(path)` reads the perfetto trace jax writes (`trace.json.gz`, Chrome's JSON event format)
and returns, per device stream: kernels, busy time (the union of their intervals) over the stream's
window (its first event to its last, so idle time at the trace's edges is left out), gaps between
kernels by size, and the kernels by total time in coarse classes (matmul,
attention, the rest); per host thread: the named events taking the most time. It is how `bench core
--profile` answers "is the device waiting on the host, or slow at its own work?" without carrying the
trace (tens of MB) off the GPU machine.
"""

from __future__ import annotations

import collections
import gzip
import json
import re

# Kernel name fragments by class; the first class that matches wins.
_CLASSES = (
    ("attention", re.compile(r"ragged_attention|attention|flash", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|matmul|dot|wgmma|sm90", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)
_GAP_EDGES_US = (5, 20, 100, 1000)


def kernel_class(name: str) -> str:
    for label, pattern in _CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def _gaps(intervals: list[tuple[float, float]]) -> dict:
    """Idle stretches between consecutive kernels, counted and summed by size (microseconds)."""
    counts = collections.Counter()
    totals = collections.Counter()
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gap = start - end
            label = next((f"<{edge}us" for edge in _GAP_EDGES_US if gap < edge), f">={_GAP_EDGES_US[-1]}us")
            counts[label] += 1
            totals[label] += gap
        end = stop if end is None else max(end, stop)
    return {label: {"count": counts[label], "total_ms": round(totals[label] / 1e3, 3)} for label in counts}


def _top(durations: dict[str, list[float]], n: int) -> list[dict]:
    rows = sorted(durations.items(), key=lambda item: -sum(item[1]))[:n]
    return [{"name": name[:120], "count": len(d), "total_ms": round(sum(d) / 1e3, 3),
             "mean_us": round(sum(d) / len(d), 1)} for name, d in rows]


def summarize(path: str, top: int = 15) -> dict:
    """Per device stream and per busy host thread: counts, busy time, gaps and the heaviest events."""
    events = _load(path)
    process_names, thread_names = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e["pid"]] = e.get("args", {}).get("name", str(e["pid"]))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", str(e.get("tid")))
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e["pid"], e.get("tid"))].append(e)
    device, host = [], []
    for (pid, tid), thread_events in by_thread.items():
        process = process_names.get(pid, str(pid))
        intervals = [(e["ts"], e["ts"] + e["dur"]) for e in thread_events]
        window = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
        durations: dict[str, list[float]] = collections.defaultdict(list)
        for e in thread_events:
            durations[e["name"]].append(e["dur"])
        row = {"process": process, "thread": thread_names.get((pid, tid), str(tid)), "events": len(thread_events),
               "window_ms": round(window / 1e3, 3), "busy_ms": round(_union_us(intervals) / 1e3, 3)}
        if "gpu" in process.lower() or "device" in process.lower():
            by_class = collections.Counter()
            for e in thread_events:
                by_class[kernel_class(e["name"])] += e["dur"]
            row.update(busy_fraction=round(row["busy_ms"] / max(row["window_ms"], 1e-9), 4),
                       by_class_ms={k: round(v / 1e3, 3) for k, v in by_class.most_common()},
                       gaps=_gaps(intervals), top=_top(durations, top))
            device.append(row)
        else:
            row["top"] = _top(durations, top)
            host.append(row)
    device.sort(key=lambda r: -r["busy_ms"])
    host.sort(key=lambda r: -r["busy_ms"])
    return {"device": device, "host": host[:6]}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="perfetto trace.json.gz from jax.profiler")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps(summarize(args.trace, args.top), indent=1))


if __name__ == "__main__":
    main()
