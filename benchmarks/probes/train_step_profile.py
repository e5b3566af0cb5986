"""Why a small training step's backward is far from its weight reads (train_step_parts.json: about 16 ms
at 64 tokens against 7.0 ms for dX = dY W^T alone). For the 64-token forward and gradient programs:
XLA's own cost analysis (bytes accessed, flops), and a profile of a few gradient calls with the device
kernels summed by name, the heaviest first.

On an H100 (train_step_profile.json, 64 tokens, llama-8b's 16.1 GB of params): XLA counts 16.6 GB
accessed by the forward and 29.4 GB by the gradient (8.8 ms at 3.35 TB/s). The gradient's device
kernels sum to 20.25 ms of its 24.7 ms call. Its eight large GEMM kinds (32 calls each) take 11.3 ms,
about 1.2x the weights' two reads. The other ~9 ms are hundreds of small fusions (reductions,
transposes, converts, multiplies: the norms, the adapter's terms, attention, f32 casts). About 4.5 ms
are gaps between kernels. The small step's excess is kernels and launches, not weight traffic. By kind
(a second run): 3,281 kernels per call; 1,313 GEMMs take 15.1 ms (the eight large kinds 11.3, about a
thousand small ones, the adapter's rank-16 products among them, 3.8); 1,968 other kernels 5.2 ms. At
512 tokens (PROBE_LENGTH=512, train_step_profile_512.json): 3,508 kernels, GEMMs 30.7 ms, others 11.3.

    PYTHONPATH=. python benchmarks/probes/train_step_profile.py   (train_step_profile.json: on an H100)
"""
import collections
import functools
import glob
import gzip
import json
import os
import tempfile

import jax

from orca_jax.finetune.model import grad_fn, loss_sums
from training_setup import MODEL, Setup, write_result

LENGTH = int(os.environ.get("PROBE_LENGTH", 64))
CALLS = 5

setup = Setup()
stage, spec, adapter = setup.stage, setup.spec, setup.adapter
batch = setup.row(LENGTH)
params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(stage.params))
result = {"model": MODEL, "device": jax.devices()[0].device_kind, "tokens": LENGTH, "params_bytes": params_bytes,
          "programs": {}}
programs = {"forward": jax.jit(functools.partial(loss_sums, decoder=stage.model, scaling=spec.scaling, remat=False)),
            "gradient": jax.jit(grad_fn(stage.model, spec.scaling, remat=False))}
compiled = {}
for name, fn in programs.items():
    compiled[name] = fn.lower(adapter, stage.params, batch).compile()
    cost = compiled[name].cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    result["programs"][name] = {"bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                                "flops": float(cost.get("flops", 0.0))}
print(json.dumps(result), flush=True)

gradient = compiled["gradient"]
jax.block_until_ready(gradient(adapter, stage.params, batch))
trace_dir = tempfile.mkdtemp()
with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(CALLS):
        out = gradient(adapter, stage.params, batch)
    jax.block_until_ready(out)
[path] = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
with gzip.open(path) as f:
    trace = json.load(f)
events = trace["traceEvents"] if isinstance(trace, dict) else trace
# Device kernels: the process named for a GPU (pid -> name from the metadata events).
names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
device_pids = {pid for pid, name in names.items() if "/device:GPU" in name or "GPU:" in name}
by_kernel = collections.defaultdict(lambda: [0.0, 0])
for e in events:
    if e.get("ph") == "X" and e.get("pid") in device_pids:
        by_kernel[e["name"]][0] += e.get("dur", 0.0) / 1e3 / CALLS  # ms per call
        by_kernel[e["name"]][1] += 1
top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25]
result["device_processes"] = sorted(names[p] for p in device_pids)
result["processes"] = sorted(set(names.values()))[:40]
result["kernels_ms_per_call"] = [{"name": name[:160], "ms": ms, "count": count // CALLS} for name, (ms, count) in top]
result["kernels_total_ms_per_call"] = sum(ms for ms, _ in by_kernel.values())
result["kernels_per_call"] = sum(count for _, count in by_kernel.values()) // CALLS


def kind(name: str) -> str:
    """A kernel's kind from its name: XLA's GEMM fusions and cuBLAS's kernels, else the fusion's first word."""
    if name.startswith(("gemm_fusion", "nvjet", "sm90_xmma", "cutlass")) or "gemm" in name:
        return "gemm"
    return name.split("_fusion")[0] if "_fusion" in name else name.split("_")[0]


by_kind = collections.defaultdict(lambda: [0.0, 0])
for name, (ms, count) in by_kernel.items():
    by_kind[kind(name)][0] += ms
    by_kind[kind(name)][1] += count // CALLS
result["kinds_ms_per_call"] = {k: {"ms": ms, "kernels": n}
                               for k, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])}
print(json.dumps(result, indent=1), flush=True)
write_result(result, os.environ.get("PROBE_OUTPUT", "train_step_profile.json"))
