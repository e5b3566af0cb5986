"""Probe: which XLA options put a tensor-parallel decode's all-reduces inside its CUDA graph.

A tensor-parallel (Megatron) stand-in for a llama decode forward, without attention: per layer a
norm, the QKV and output projections (one all-reduce), the gated MLP (a second all-reduce), on
random bf16 weights drawn on the devices. For each option set in --variants (a JSON list of
{"name", "xla_flags", optional "env"}) a fresh process compiles it, dumps the optimized HLO, and times:
- `stable`: the same input buffer every call (the recorded graph can be launched unchanged);
- `chained`: each call's output is the next call's input (new buffer addresses every call, as an
  engine's iterations have);
- `donated`: the same input, the output written into a donated buffer (the previous call's output):
  no address changes at all;
as host ms per call until 30 calls have returned (`dispatch`) and wall ms per call until the device
is done (`wall`). From the dump: how many command-buffer computations the program has and how many
of its all-reduces sit inside one.

    python benchmarks/probes/collective_graphs.py --tp 2 --out DIR [--variants JSON]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

DEFAULT_VARIANTS = [
    {"name": "defaults", "xla_flags": ""},
]


def run_variant(args) -> dict:
    """In this process (XLA_FLAGS already set by the parent): build, compile, time."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    tp = args.tp
    devices = np.array(jax.devices()[:tp])
    mesh = Mesh(devices, ("tensor",))
    H, F, QKV, L, B = args.hidden, args.ffn, args.qkv, args.layers, args.batch
    col = NamedSharding(mesh, P(None, "tensor"))
    row = NamedSharding(mesh, P("tensor", None))
    rep = NamedSharding(mesh, P())

    drawers = {}

    def draw(shape, sharding, seed):  # one program per shape, drawn on the devices
        if (shape, sharding) not in drawers:
            drawers[(shape, sharding)] = jax.jit(
                lambda key: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16),
                out_shardings=sharding)
        return drawers[(shape, sharding)](jax.random.key(seed))

    layers = [dict(qkv=draw((H, QKV), col, 4 * i), o=draw((H, H), row, 4 * i + 1),
                   up=draw((H, 2 * F), col, 4 * i + 2), down=draw((F, H), row, 4 * i + 3)) for i in range(L)]

    def layer_fn(x, w):  # x bf16[B, H] replicated; weights: this shard's columns / rows
        def norm(v):
            v32 = v.astype(jnp.float32)
            return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-5)).astype(v.dtype)
        a = norm(x) @ w["qkv"]  # [B, QKV/tp]
        attn = a[:, : w["o"].shape[0]]  # stands in for attention's output
        x = x + jax.lax.psum(attn @ w["o"], "tensor")
        gu = norm(x) @ w["up"]  # [B, 2F/tp]
        g, u = jnp.split(gu, 2, axis=-1)
        return x + jax.lax.psum((jax.nn.silu(g) * u) @ w["down"], "tensor")

    specs = [dict(qkv=P(None, "tensor"), o=P("tensor", None), up=P(None, "tensor"), down=P("tensor", None))] * L

    def forward(x, ws):
        for w in ws:
            x = layer_fn(x, w)
        return x

    fn = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(P(), specs), out_specs=P(), check_vma=False))
    x0 = jax.device_put(jnp.ones((B, H), jnp.bfloat16) * 0.1, rep)
    start = time.perf_counter()
    compiled = fn.lower(x0, layers).compile()
    compile_s = time.perf_counter() - start

    # The same forward writing its output into a donated buffer: every address stable call to call.
    donating = jax.jit(jax.shard_map(lambda x, buf, ws: forward(x, ws), mesh=mesh, in_specs=(P(), P(), specs),
                                     out_specs=P(), check_vma=False), donate_argnums=(1,), keep_unused=True)
    donated = donating.lower(x0, x0, layers).compile()

    def replay(mode: str, repeats: int = 30) -> tuple[float, float]:
        x = compiled(x0, layers)
        jax.block_until_ready(x)
        outs = []
        start = time.perf_counter()
        for _ in range(repeats):
            if mode == "donated":
                x = donated(x0, x, layers)
                outs = [x]
                continue
            y = compiled(x if mode == "chained" else x0, layers)
            if mode == "chained":
                x = y
            outs.append(y)
        dispatched = time.perf_counter()
        jax.block_until_ready(outs)
        done = time.perf_counter()
        return 1e3 * (dispatched - start) / repeats, 1e3 * (done - start) / repeats

    result = {"compile_s": round(compile_s, 2)}
    for mode in ("stable", "chained", "donated"):
        runs = [replay(mode) for _ in range(5)]
        best = min(runs, key=lambda r: r[1])
        result[mode] = {"dispatch_ms": round(best[0], 3), "wall_ms": round(best[1], 3)}
    return result


def dump_summary(dump_dir: str) -> dict:
    """What XLA made of the forward: all-reduces in the optimized HLO, and the thunk kinds of the
    executable after its thunk passes (a kCommandBuffer holds the thunks recorded into one CUDA graph;
    thunks nested under it are indented)."""
    out = {}
    hlo = [f for f in glob.glob(os.path.join(dump_dir, "*forward*after_optimizations.txt"))
           if "buffer-assignment" not in f and "memory-usage" not in f]
    if hlo:
        text = open(max(hlo, key=os.path.getsize)).read()
        out["hlo_all_reduces"] = len(re.findall(r"\ball-reduce(?:-start)?\(", text))
        out["hlo_one_shot_fusions"] = len(re.findall(r"fused_all-reduce", text))
    thunks = glob.glob(os.path.join(dump_dir, "*forward*thunk_sequence*"))
    if thunks:
        text = open(max(thunks, key=os.path.getsize)).read()
        kinds = re.findall(r"^(\s*)(k[A-Z][A-Za-z]+)", text, re.M)
        top = [k for indent, k in kinds if not indent]
        out["thunk_file"] = os.path.basename(max(thunks, key=os.path.getsize))
        out["top_level_thunks"] = {k: top.count(k) for k in sorted(set(top))}
        out["nested_thunks"] = {k: n for k in sorted({k for i, k in kinds if i})
                                if (n := sum(1 for i, kk in kinds if i and kk == k))}
    return out or {"dump": "none"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--qkv", type=int, default=6144)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_variant(args)))
        return
    os.makedirs(args.out, exist_ok=True)
    variants = json.loads(args.variants)
    results = []
    for variant in variants:
        dump = os.path.join(args.out, "dump_" + variant["name"])
        env = dict(os.environ, **variant.get("env", {}))
        env["XLA_FLAGS"] = (f"{variant['xla_flags']} --xla_dump_to={dump} --xla_dump_hlo_as_text"
                            " --xla_dump_hlo_module_re=.*forward.*").strip()
        argv = [sys.executable, __file__, "--child", variant["name"]] + [a for a in sys.argv[1:]]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args_timeout())
        row = {"name": variant["name"], "xla_flags": variant["xla_flags"], "env": variant.get("env", {}),
               "tp": args.tp}
        if proc.returncode == 0:
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            row["error"] = proc.stderr[-1500:]
        row.update(dump_summary(dump))
        results.append(row)
        print(json.dumps(row), flush=True)
        # Keep only the optimized module (the dump is large).
        for path in glob.glob(os.path.join(dump, "*")):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif not (path.endswith("after_optimizations.txt") or "thunk_sequence" in path):
                os.remove(path)
    with open(os.path.join(args.out, f"collective_graphs_tp{args.tp}_{args.layers}x{args.hidden}.json"), "w") as f:
        json.dump({"shapes": {k: getattr(args, k) for k in ("layers", "hidden", "qkv", "ffn", "batch")},
                   "results": results}, f, indent=1)


def args_timeout() -> int:
    return int(os.environ.get("PROBE_VARIANT_TIMEOUT", "240"))


if __name__ == "__main__":
    main()
