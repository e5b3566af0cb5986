"""Probe: which FP8 matmul form is fastest inside a whole 32-layer program, by batch rows M.

A llama-8b MLP stand-in: 16 pairs of up [4096 -> 14336] and down [14336 -> 4096] projections, each
layer's weight its own array (as the engine keeps them), chained in one jitted program and called back
to back with no host wait (a single jitted matmul of these sizes is dispatch-bound). Forms:
- bf16: XLA's dot on bf16 weights [K, N] (today's engine);
- xla_w8a16: e4m3 [N, K] weights converted to bf16 by XLA inside the program;
- xla_w8a8_nk / _kn: activations quantized per row to e4m3, XLA's FP8 x FP8 dot (cuBLASLt on Hopper),
  weights [N, K] (both operands K-major) or [K, N];
- pallas_*: kernels/fp8_matmul.py's W8A16 kernel with several tilings.
Prints us per layer, TB/s of weight bytes, and the relative error against an f32 product.

    python benchmarks/probes/fp8_forms.py --json OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels.fp8_matmul import TileConfig, quantize_per_channel, w8a16_matmul

H, F, PAIRS = 4096, 14336, 16


def quantize_rows(x):
    """x [M, K] -> (e4m3 [M, K], f32 [M, 1]): one scale per row (dynamic, per token)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.maximum(amax, 1e-6) / 448.0
    return (x.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale


def w8a8_nk(x, w, s):
    xq, xs = quantize_rows(x)
    y = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * s[None, :]).astype(jnp.bfloat16)


def w8a8_kn(x, w, s):
    xq, xs = quantize_rows(x)
    y = jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * s[None, :]).astype(jnp.bfloat16)


def xla_w8a16(x, w, s):
    return jnp.einsum("MK,NK->MN", x, w.astype(jnp.bfloat16)) * s[None, :].astype(jnp.bfloat16)


def bf16(x, w, s):
    del s
    return jnp.dot(x, w)


def chain(matmul, x, weights, scales):
    for w, s in zip(weights, scales):
        x = matmul(x, w, s)
        x = x / (jnp.max(jnp.abs(x.astype(jnp.float32))) + 1).astype(x.dtype)  # keeps values bounded
    return x


def make_weights(form: str, key):
    """32 weights (alternating [H, F] and [F, H] in the model's sense) in the form's layout."""
    ws, ss = [], []
    for i in range(2 * PAIRS):
        k_in, n_out = (H, F) if i % 2 == 0 else (F, H)
        w = jax.random.normal(jax.random.fold_in(key, i), (n_out, k_in), jnp.bfloat16) * 0.02  # [N, K]
        if form == "bf16":
            ws.append(w.T.copy())
            ss.append(jnp.ones((n_out,), jnp.float32))
            continue
        q, s = quantize_per_channel(w, axis=1)
        ws.append(q.T.copy() if form == "xla_w8a8_kn" else q)
        ss.append(s)
    jax.block_until_ready(ws)
    return ws, ss


def time_program(fn, x, ws, ss, repeats: int) -> float:
    out = fn(x, ws, ss)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(out[:, :H] if out.shape[1] != H else out, ws, ss)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    global H, F, PAIRS
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shape", default=f"{H},{F},{PAIRS}", help="hidden,ffn,pairs (small ones for a CPU check)")
    parser.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (CPU)")
    parser.add_argument("--pallas-max-rows", type=int, default=128, help="the kernel is for decode-sized batches")
    args = parser.parse_args()
    H, F, PAIRS = (int(v) for v in args.shape.split(","))
    key = jax.random.key(0)
    pallas = {
        "pallas_n128_k128_s4": TileConfig(block_n=128, block_k=128, split_k=4),
        "pallas_n32_k512_s2_w4": TileConfig(block_n=32, block_k=512, split_k=2, num_stages=3),
        "pallas_n32_k512_s2_bits": TileConfig(block_n=32, block_k=512, split_k=2, num_stages=3, convert="bits"),
        "pallas_n64_k256_s4_bits": TileConfig(block_n=64, block_k=256, split_k=4, convert="bits"),
        "pallas_n32_k256_s4_bits": TileConfig(block_n=32, block_k=256, split_k=4, convert="bits"),
        "pallas_n32_k256_s4": TileConfig(block_n=32, block_k=256, split_k=4),
        "pallas_n16_k512_s4_bits_w2": TileConfig(block_n=16, block_k=512, split_k=4, num_warps=2, convert="bits"),
    }
    forms = {"bf16": bf16, "xla_w8a16": xla_w8a16, "xla_w8a8_nk": w8a8_nk, "xla_w8a8_kn": w8a8_kn}
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name in list(forms) + list(pallas):
        layout = name if name in forms else "pallas"
        try:
            ws, ss = make_weights("xla_w8a8_kn" if layout == "xla_w8a8_kn" else ("bf16" if layout == "bf16" else "fp8"), key)
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            print(name, "weights failed", e)
            continue
        weight_bytes = sum(w.nbytes for w in ws)
        for m in rows:
            tiles = pallas.get(name)
            if tiles is not None and m > args.pallas_max_rows:
                continue
            if tiles is not None and m > 16:
                tiles = dataclasses.replace(tiles, block_m=min(64, 1 << (m - 1).bit_length()))
            matmul = forms[name] if tiles is None else functools.partial(w8a16_matmul, tiles=tiles, interpret=args.interpret)
            fn = jax.jit(functools.partial(chain, matmul))
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, H), jnp.bfloat16)
            try:
                seconds = time_program(fn, x, ws, ss, args.repeats)
                one = jax.jit(matmul)(x, ws[0], ss[0]).astype(jnp.float32)
                ref = x.astype(jnp.float32) @ (
                    ws[0].astype(jnp.float32) if layout == "bf16" else
                    (ws[0].astype(jnp.float32) * ss[0][None, :] if layout == "xla_w8a8_kn"
                     else (ws[0].astype(jnp.float32) * ss[0][:, None]).T))
                err = float(jnp.linalg.norm(one - ref) / jnp.linalg.norm(ref))
            except Exception as e:  # noqa: BLE001
                print(f"{name} M={m}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                results.append({"form": name, "rows": m, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            us = 1e6 * seconds / (2 * PAIRS)
            row = {"form": name, "rows": m, "us_per_layer": us, "weight_tb_s": weight_bytes / seconds / 1e12,
                   "rel_err": err}
            results.append(row)
            print(f"{name:24s} M={m:5d} {us:8.1f} us/layer {row['weight_tb_s']:5.2f} TB/s err {err}", flush=True)
        del ws, ss
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
