"""Can a fine-tuning backward ride in a decode iteration's weight reads under XLA? The question fused
co-serving (FlexLLM) turns on: a decode iteration is bound by reading the weights once, and a LoRA
backward's activation gradient (dX = dY W^T through the frozen weights) reads them again.

Llama-8b's projection shapes (32 layers, random bf16; attention, norms and the adapter left out: they
read little), one program per variant, median of timed calls:
- decode: B tokens through every layer (x W);
- decode + forward ride: B + T tokens (the training forward in the same GEMMs);
- backward alone: T tokens of dY W^T per layer, each layer's dY its own input (a backward staggered one
  layer per iteration across micro-batches needs no chain within one iteration);
- decode + backward ride: both in one layer loop, each layer's W read by both GEMMs (does XLA or the
  L2 cache share the read?);
- the same with the MLP's weights split in column/row blocks of 16 MB, the backward's GEMM on a block
  right after the decode's (a block fits H100's 50 MB L2, so the second read may hit it).
The weight-read bound of the decode variant is printed beside: bytes / 3.35 TB/s.

On an H100 (coserving_shared_reads.json): decode 5.58 ms (bound 4.17); + 64 / 128 forward tokens 6.34 /
6.50 ms; the backward of 64 tokens alone 7.00 ms; decode + that backward 12.46 ms (6.87 ms more: the
second read is not shared); blocked, 24.4 ms (the small unrolled GEMMs cost more than L2 gives back).
So the forward rides almost free, and the backward needs a kernel reading each W tile once for both.

    PYTHONPATH=. python benchmarks/probes/coserving_shared_reads.py   (coserving_shared_reads.json)
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from training_setup import write_result

H, F, QKV, L = 4096, 14336, 6144, int(os.environ.get("PROBE_LAYERS", 32))
B = 16  # decode tokens
RIDES = (64, 128)
BLOCK = 2048  # MLP columns (gate|up) / rows (down) per block: 4096 x 2048 x 2 B = 16 MB
HBM_BYTES_PER_S = 3.35e12
DT = jnp.bfloat16

key = jax.random.PRNGKey(0)
ks = jax.random.split(key, 4)
scale = 0.02
# One dict per layer, the layer loop unrolled in Python as the engine's is: a lax.scan over stacked
# weights measured 15.2 ms for the decode (3.6x the read bound; the per-layer slices were copied).
SHAPES = (("qkv", (H, QKV)), ("o", (H, H)), ("gate_up", (H, 2 * F)), ("down", (F, H)))
weights = [{name: (jax.random.normal(jax.random.fold_in(k, layer), shape, jnp.float32) * scale).astype(DT)
            for (name, shape), k in zip(SHAPES, ks)}
           for layer in range(L)]
weight_bytes = sum(w.size * w.dtype.itemsize for layer in weights for w in layer.values())


def fwd_layer(x, w):  # x [M, H]
    h = x @ w["qkv"]  # [M, QKV]
    x = x + h[:, :H] @ w["o"]
    g = x @ w["gate_up"]  # [M, 2F]
    return x + (jax.nn.silu(g[:, :F]) * g[:, F:]) @ w["down"]


def bwd_layer(dy, w):  # dy [T, H] -> dX [T, H] through the frozen weights (elementwise parts stand-ins)
    du = dy @ w["down"].T  # [T, F]
    dx = dy + jnp.concatenate([du, du], axis=-1) @ w["gate_up"].T
    da = dx @ w["o"].T  # [T, H]
    return dx + jnp.pad(da, ((0, 0), (0, QKV - H))) @ w["qkv"].T


def fwd_bwd_blocked(x, dy, w):
    """Decode forward and backward on one layer, the MLP in 16 MB blocks, each block's two GEMMs together."""
    h = x @ w["qkv"]
    x = x + h[:, :H] @ w["o"]
    gu = w["gate_up"].reshape(H, 2, F // BLOCK, BLOCK)
    dn = w["down"].reshape(F // BLOCK, BLOCK, H)
    du_parts = []
    for b in range(F // BLOCK):  # unrolled: the down block's GEMMs, then the gate|up block's
        du_parts.append(dy @ dn[b].T)  # [T, BLOCK]
    g_parts = []
    dx_mlp = jnp.zeros_like(dy)
    for b in range(F // BLOCK):
        blk = gu[:, :, b, :].reshape(H, 2 * BLOCK)
        g_parts.append(x @ blk)  # [M, 2 BLOCK]
        dx_mlp = dx_mlp + jnp.concatenate([du_parts[b], du_parts[b]], axis=-1) @ blk.T
    y = x
    for b in range(F // BLOCK):
        g = g_parts[b]
        y = y + (jax.nn.silu(g[:, :BLOCK]) * g[:, BLOCK:]) @ dn[b]
    dx = dy + dx_mlp
    da = dx @ w["o"].T
    dq = dx + jnp.pad(da, ((0, 0), (0, QKV - H))) @ w["qkv"].T
    return y, dq


def decode(x, weights):
    for w in weights:
        x = fwd_layer(x, w)
    return x


def backward(dys, weights):  # dys [L, T, H]
    return [bwd_layer(dys[i], w) for i, w in enumerate(weights)]


def decode_and_backward(x, dys, weights):
    dxs = []
    for i, w in enumerate(weights):
        x = fwd_layer(x, w)
        dxs.append(bwd_layer(dys[i], w))
    return x, dxs


def decode_and_backward_blocked(x, dys, weights):
    dxs = []
    for i, w in enumerate(weights):
        x, dx = fwd_bwd_blocked(x, dys[i], w)
        dxs.append(dx)
    return x, dxs


def timed_ms(fn, *args, n=30) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(B, H)) * 0.1, DT)
result = {"device": jax.devices()[0].device_kind, "layers": L, "decode_tokens": B, "weight_bytes": weight_bytes,
          "weight_read_bound_ms": 1e3 * weight_bytes / HBM_BYTES_PER_S, "decode_ms": timed_ms(decode, x, weights),
          "rides": {}}
print(json.dumps(result), flush=True)
for t in RIDES:
    xt = jnp.asarray(rng.normal(size=(B + t, H)) * 0.1, DT)
    dys = jnp.asarray(rng.normal(size=(L, t, H)) * 0.1, DT)
    row = {"decode_plus_forward_ms": timed_ms(decode, xt, weights),
           "backward_alone_ms": timed_ms(backward, dys, weights),
           "decode_plus_backward_ms": timed_ms(decode_and_backward, x, dys, weights),
           "decode_plus_backward_blocked_ms": timed_ms(decode_and_backward_blocked, x, dys, weights)}
    # Shared reads would put decode + backward near decode alone; none, near decode + backward alone.
    row["backward_extra_ms"] = row["decode_plus_backward_ms"] - result["decode_ms"]
    row["backward_extra_blocked_ms"] = row["decode_plus_backward_blocked_ms"] - result["decode_ms"]
    result["rides"][str(t)] = row
    print(t, json.dumps(row), flush=True)
write_result(result, "coserving_shared_reads.json")
