"""Summarize a jax profiler trace written by mesh_profile.py: per forward call, the device's kernels by
kind and the host's launch work by kind (CUDA graph launches, collective launches, argument handling).

    python benchmarks/probes/mesh_trace_summary.py TRACE.trace.json.gz [...] > summary.json
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys

TOP = 40
FORWARD = re.compile(r"^(\[\d+\] )?CommonPjRtLoadedExecutable::Execute \(jit__stage_forward\)$")


def kind_of(kernel: str) -> str:
    if "all_reduce" in kernel or "all-reduce" in kernel or "nccl" in kernel.lower():
        return "collective"
    if kernel.startswith("gemm") or "dot" in kernel:
        return "gemm"
    if "ragged_attention" in kernel:
        return "attention"
    return "other"


def summarize(path: str) -> dict:
    events = json.load(gzip.open(path))["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    forwards = [e for e in spans if processes.get(e["pid"], "").startswith("/host") and FORWARD.match(e["name"])]
    # A forward is one span on the calling thread, and on N devices one more per device ("[i] ..."),
    # on the thread launching that device's work: the host's launch work is read from device 0's.
    calls = len([e for e in forwards if not e["name"].startswith("[")]) or 1
    per_device = [e for e in forwards if e["name"].startswith("[0]")]
    forwards = per_device or forwards
    devices = {}
    for pid, name in processes.items():
        if not name.startswith("/device"):
            continue
        kernels = [e for e in spans if e["pid"] == pid]
        if not kernels:
            continue
        count, micros = collections.Counter(), collections.Counter()
        by_name, by_name_count = collections.Counter(), collections.Counter()
        for e in kernels:
            count[kind_of(e["name"])] += 1
            micros[kind_of(e["name"])] += e["dur"]
            # Numbered clones of one fusion (fusion.12, fusion.13) are one kind of kernel here.
            base = re.sub(r"[._]\d+$", "", e["name"])
            by_name[base] += e["dur"]
            by_name_count[base] += 1
        devices[name] = {k: {"kernels_per_call": count[k] / calls, "ms_per_call": micros[k] / 1e3 / calls}
                         for k in count}
        # The kernels that cost most, per call: what a fused kernel would have to absorb.
        devices[name]["top_kernels"] = [
            {"kernel": k[:120], "per_call": by_name_count[k] / calls, "us_per_call": us / calls}
            for k, us in by_name.most_common(TOP)]
    host = collections.Counter()
    launches = collections.Counter()
    for call in forwards:
        inside = [e for e in spans if e["tid"] == call["tid"] and call["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= call["ts"] + call["dur"]]
        for e in inside:
            name = re.sub(r"\d+", "N", e["name"])
            if name in ("cuGraphLaunch (CudaGraph:N)", "fusion-start.N", "command_buffer::update",
                        "Handle inputs", "Thunks::Initialize", "Rendezvous"):
                host[name] += e["dur"]
                launches[name] += 1
    per_thread = 1
    return {"trace": path.rsplit("/", 1)[-1], "forward_calls": calls,
            "forward_host_ms_per_call_per_device": sum(e["dur"] for e in forwards) / 1e3 / calls / per_thread,
            "host_ms_per_call_per_device": {k: v / 1e3 / calls / per_thread for k, v in host.items()},
            "host_count_per_call_per_device": {k: v / calls / per_thread for k, v in launches.items()},
            "device": devices}


if __name__ == "__main__":
    print(json.dumps([summarize(p) for p in sys.argv[1:]], indent=1))
