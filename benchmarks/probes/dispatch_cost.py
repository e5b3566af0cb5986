"""Probe: what one process pays to dispatch a many-kernel program to 1 device and to several.

A stand-in for a decode step's shape: --layers blocks of a few small matmuls and elementwise ops on
[tokens, hidden] (batch-1 decode: tokens = 1), run
- on one device;
- replicated on N devices (the same program on each, no communication);
- tensor-parallel on N devices (weights split, one all-reduce per block, as Megatron's MLP).
Printed per variant: host ms per call until every call returned (dispatch), and wall ms per call once
the devices are done. If dispatch grows with N while the device time falls, the host is what limits a
one-process mesh.

    python benchmarks/probes/dispatch_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def block_stack(x, ws):
    for w1, w2 in ws:  # [H, F], [F, H]
        h = jax.nn.silu(x @ w1)
        x = x + h @ w2
        x = x * jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-5).astype(x.dtype)
    return x


def timed(fn, *args, repeats: int = 50) -> tuple[float, float]:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(repeats)]
    dispatched = time.perf_counter()
    jax.block_until_ready(outs)
    done = time.perf_counter()
    return 1e3 * (dispatched - start) / repeats, 1e3 * (done - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    devices = jax.devices()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.tokens, args.hidden)), jnp.bfloat16)
    ws = [(jnp.asarray(rng.standard_normal((args.hidden, args.ffn)) * 0.01, jnp.bfloat16),
           jnp.asarray(rng.standard_normal((args.ffn, args.hidden)) * 0.01, jnp.bfloat16))
          for _ in range(args.layers)]
    rows = {}
    one = jax.jit(block_stack)
    rows["1 device"] = timed(one, x, ws)
    n = len(devices)
    if n > 1:
        mesh = Mesh(np.array(devices), ("tensor",))
        rep = NamedSharding(mesh, P())
        xr, wr = jax.device_put(x, rep), jax.device_put(ws, rep)
        rows[f"replicated on {n}"] = timed(jax.jit(block_stack), xr, wr)
        col, row = NamedSharding(mesh, P(None, "tensor")), NamedSharding(mesh, P("tensor", None))
        wt = [(jax.device_put(a, col), jax.device_put(b, row)) for a, b in ws]
        rows[f"tensor-parallel on {n}"] = timed(jax.jit(block_stack, out_shardings=rep), xr, wt)
    for name, (dispatch, wall) in rows.items():
        print(f"{name:24s} dispatch {dispatch:7.3f} ms/call   wall {wall:7.3f} ms/call", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dispatch_cost.json"), "w") as f:
        json.dump({"args": vars(args), "device": devices[0].device_kind, "jax": jax.__version__,
                   "rows": {k: {"dispatch_ms": d, "wall_ms": w} for k, (d, w) in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
