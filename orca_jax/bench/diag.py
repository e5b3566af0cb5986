"""A standalone check of one suspicion about decode speed: does a lax.scan over stacked layer weights
read each layer's weights more than once on this backend? Times L layers of x @ W (x: [T, H], W: [H, F])
as a scan over stacked weights and as an unrolled Python loop over separate arrays, against the
bytes-read bound. Run once plainly and once with XLA_FLAGS set to compare compiler options."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from orca_jax.bench.timing import time_call


def scan_vs_unrolled(num_layers: int = 32, hidden: int = 4096, ffn: int = 14336, tokens=(8, 128)) -> dict:
    keys = jax.random.split(jax.random.key(0), num_layers)
    stacked = jax.vmap(lambda k: jax.random.normal(k, (hidden, ffn), jnp.bfloat16) * 0.01)(keys)  # [L, H, F]
    down = jnp.swapaxes(stacked, 1, 2)  # [L, F, H]: x @ W @ W^T keeps x's shape
    layers = [(stacked[i], down[i]) for i in range(num_layers)]

    @jax.jit
    def scanned(x, up, dn):
        def body(h, w):
            return (h @ w[0]) @ w[1], None
        return jax.lax.scan(body, x, (up, dn))[0]

    @jax.jit
    def unrolled(x, ws):
        for up, dn in ws:
            x = (x @ up) @ dn
        return x

    weight_bytes = 2 * stacked.nbytes
    rows = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(1), (t, hidden), jnp.bfloat16)
        s, u = (time_call(scanned, x, stacked, down, warmup=1, iters=20, reps=1),
                time_call(unrolled, x, layers, warmup=1, iters=20, reps=1))
        rows.append({"tokens": t, "scan_ms": 1e3 * s, "unrolled_ms": 1e3 * u,
                     "scan_GB_s": weight_bytes / s / 1e9, "unrolled_GB_s": weight_bytes / u / 1e9})
    return {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind,
            "weight_bytes": weight_bytes, "rows": rows}


if __name__ == "__main__":
    print(json.dumps(scan_vs_unrolled()))
