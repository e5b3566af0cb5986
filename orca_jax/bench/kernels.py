"""Ragged paged attention on a GPU: correctness against the jnp reference, then timings.

Run:  python -m orca_jax.bench kernels --out DIR [--sweep]
Writes DIR/kernel_bench.json and prints a short table last. Timings are jax-side: warm-up, then the
median over repetitions of (back-to-back calls / count), so host dispatch overlaps device work; a call
runs about five kernels (schedule, passes, split combine), so rows under ~70 us may be bounded by
their launches rather than by the GPU. Results: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.timing import time_call
from orca_jax.kernels import ragged_attention as ra
from orca_jax.kernels import ragged_attention_tiles as tiles

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64)


@dataclasses.dataclass
class Batch:
    args: tuple  # the reference's positional arguments
    kv_bytes: int  # K and V bytes a perfect kernel reads once
    flops: float  # causal attention flops (QK^T and PV)
    num_tokens: int


def make_batch(q_lens, kv_lens, *, num_heads, num_kv_heads, head_dim, page_size=16,
               dtype=jnp.bfloat16, num_layers=2, pad_tokens=0, pad_seqs=0, seed=0) -> Batch:
    """A ragged batch with pages in scattered order; K/V random on the device."""
    rng = np.random.default_rng(seed)
    num_live = len(q_lens)
    num_slots = num_live + pad_seqs
    pages_per_seq = max(-(-k // page_size) for k in kv_lens)
    used = sum(-(-k // page_size) for k in kv_lens)
    num_pages = used + 1  # page 0: scratch
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_table = np.zeros((num_slots, pages_per_seq), np.int32)
    cursor = 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // page_size)
        page_table[s, :n] = order[cursor:cursor + n]
        cursor += n
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1:] = cu[num_live]
    kvl = np.zeros(num_slots, np.int32)
    kvl[:num_live] = kv_lens
    num_tokens = int(cu[num_live]) + pad_tokens
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(kq, (num_tokens, num_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype)
    v = jax.random.normal(kv_, cache_shape, jnp.float32).astype(dtype)
    args = (q, k, v, jnp.int32(num_layers - 1), jnp.asarray(cu), jnp.asarray(kvl),
            jnp.asarray(page_table), jnp.asarray([num_live], jnp.int32))
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * sum(kv_lens) * num_kv_heads * head_dim * itemsize
    # Query i of a request sees kv - q + i + 1 keys; 4 flops per (query head, key, dim).
    pairs = sum(ql * (kv - ql) + ql * (ql + 1) // 2 for ql, kv in zip(q_lens, kv_lens))
    return Batch(args, kv_bytes, 4.0 * pairs * num_heads * head_dim, num_tokens)


def kernel_fn(block_sizes=None):
    return jax.jit(functools.partial(ra.ragged_attention, block_sizes=block_sizes))


reference_fn = jax.jit(ra.ragged_attention_reference)


def copy_bandwidth(num_bytes=1 << 30) -> dict:
    """Device-to-device bandwidth, read + write bytes per second: a jax elementwise pass and a
    plain memcpy (torch's copy_, timed with CUDA events by triton.testing.do_bench)."""
    x = jax.random.normal(jax.random.key(0), (num_bytes // 2,), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(lambda a: a + jnp.bfloat16(1))
    result = dict(jax_elementwise_gb_s=2 * num_bytes / time_call(fn, x, iters=20) / 1e9)
    del x
    try:
        import torch
        import triton.testing
        src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
        result["memcpy_gb_s"] = 2 * num_bytes / (ms * 1e-3) / 1e9
        del src, dst
        torch.cuda.empty_cache()
    except Exception as e:
        result["memcpy_error"] = f"{type(e).__name__}: {e}"[:300]
    result["copy_gb_s"] = max(v for k, v in result.items() if k.endswith("gb_s"))  # the stricter bar
    return result


def poisoned(args):
    """NaN in the other layer and in the slots past each request's K/V length: never to be read."""
    q, k, v, layer, cu, kv_lens, page_table, num_seqs = args
    num_pages, page_size = k.shape[2], k.shape[3]
    bad = np.zeros((num_pages, page_size), bool)
    for pages, kv in zip(np.asarray(page_table), np.asarray(kv_lens)):
        if kv % page_size:
            bad[pages[kv // page_size], kv % page_size:] = True
    bad = jnp.asarray(bad)[None, :, :, None]  # [1, num_pages, page_size, 1] over KVH and D
    other = (int(layer) + 1) % k.shape[0]

    def poison(cache):
        cache = cache.at[other].set(jnp.nan)
        return cache.at[int(layer)].set(jnp.where(bad, jnp.nan, cache[int(layer)]))

    return (q, poison(k), poison(v), layer, cu, kv_lens, page_table, num_seqs)


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# ----------------------------------------------------------------------------------- sections


def check_correctness() -> list[dict]:
    cases = [  # (name, heads, page_size, dtype, q_lens, kv_lens, pad_tokens, pad_seqs, tolerance)
        ("mixed gqa4 d128 p16", LLAMA_8B, 16, jnp.bfloat16,
         [37, 1, 100, 20, 1, 1, 3], [37, 77, 100, 75, 1, 300, 9], 5, 2, 3e-2),
        ("mixed gqa4 d128 p16", LLAMA_8B, 16, jnp.float32,
         [37, 1, 100, 20, 1, 1, 3], [37, 77, 100, 75, 1, 300, 9], 5, 2, 1e-4),
        ("mixed gqa3 d64 p16", SMOLLM2, 16, jnp.bfloat16,
         [130, 1, 1, 7], [130, 513, 64, 40], 3, 1, 3e-2),
        ("mixed mha d128 p1", dict(num_heads=4, num_kv_heads=4, head_dim=128), 1, jnp.float32,
         [33, 1, 2], [50, 65, 2], 0, 0, 1e-4),
        ("mixed gqa8 d64 p64", dict(num_heads=16, num_kv_heads=2, head_dim=64), 64, jnp.bfloat16,
         [70, 1, 1], [200, 129, 64], 2, 1, 3e-2),
        ("mixed gqa4 d128 p16 small tiles", LLAMA_8B, 16, jnp.bfloat16,
         [37, 1, 100, 20, 1], [37, 77, 100, 75, 300], 5, 2, 3e-2),
        ("decode gqa4 d128 p16 auto splits", LLAMA_8B, 16, jnp.bfloat16,
         [1, 1, 1], [1000, 77, 1], 1, 1, 3e-2),
        ("decode gqa3 d64 p16 auto splits", SMOLLM2, 16, jnp.float32,
         [1, 1, 2], [1000, 500, 333], 0, 0, 1e-4),
    ]
    # 3 uneven K/V splits in the short pass, many q and K/V blocks per request.
    small_tiles = ra.BlockSizes(short=ra.Tile(16, 16), long=ra.Tile(32, 16), kv_splits=3)
    results = []
    for name, heads, ps, dtype, q_lens, kv_lens, pad_t, pad_s, tol in cases:
        row = dict(case=name, dtype=jnp.dtype(dtype).name, tolerance=tol)
        sizes = small_tiles if "small tiles" in name else None
        try:
            batch = make_batch(q_lens, kv_lens, page_size=ps, dtype=dtype, pad_tokens=pad_t,
                               pad_seqs=pad_s, **heads)
            out = kernel_fn(sizes)(*poisoned(batch.args))
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(ra.ragged_attention_reference)(*batch.args)
            row["max_abs_err"] = max_err(out, ref)
            diff = (out.astype(jnp.float32) - ref.astype(jnp.float32)).ravel()
            row["rel_l2_err"] = float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref.astype(jnp.float32)))
            row["finite"] = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
            row["ok"] = row["finite"] and row["max_abs_err"] <= tol
        except Exception as e:  # report and go on: one broken case must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        print("correctness", row, flush=True)
        results.append(row)
    return results


def bench_decode(copy_bw: float) -> list[dict]:
    rows = []
    # A 32-layer cache passes 4 GiB per array: the kernel's addresses go 64-bit, as in deployment.
    for num_seqs, kv, heads, layers, label in [
            (64, 1024, LLAMA_8B, 2, "llama-8b"), (256, 512, LLAMA_8B, 2, "llama-8b"),
            (64, 1024, LLAMA_8B, 32, "llama-8b 32-layer cache"), (8, 2048, LLAMA_8B, 2, "llama-8b"),
            (64, 1024, SMOLLM2, 2, "smollm2")]:
        batch = make_batch([1] * num_seqs, [kv] * num_seqs, num_layers=layers, **heads)
        row = dict(case=f"decode {num_seqs}x{kv} {label}", kv_splits=planned_splits(batch))
        try:
            sec = time_call(kernel_fn(), *batch.args, iters=20, reps=9)
            row.update(us=sec * 1e6, kv_gb_s=batch.kv_bytes / sec / 1e9, copy_gb_s=copy_bw / 1e9,
                       frac_of_copy=batch.kv_bytes / sec / copy_bw)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        if heads is LLAMA_8B:
            row.update(jax_paged_attention(batch))
        del batch
        print("decode", row, flush=True)
        rows.append(row)
    return rows


def planned_splits(batch: Batch) -> int:
    """The K/V splits the kernel's plan gives the short pass of this batch."""
    q, k, _, _, _, _, page_table, _ = batch.args
    group = q.shape[1] // k.shape[1]
    sizes = ra.default_block_sizes(q.shape[2], k.shape[3], group, q.dtype)
    plan = tiles.plan_passes(num_tokens=q.shape[0], num_slots=page_table.shape[0], num_heads=q.shape[1],
                             num_kv_heads=k.shape[1], head_dim=q.shape[2],
                             max_kv=page_table.shape[1] * k.shape[3], sizes=sizes,
                             group_pad=tiles.next_pow2(group))
    return plan[0].kv_splits


def jax_paged_attention(batch: Batch) -> dict:
    """jax's own Pallas GPU paged_attention on a decode-only batch, same cache layer."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
    except ImportError as e:
        return dict(jax_paged_error=str(e))
    q, k, v, layer, _, kv_lens, page_table, _ = batch.args
    k_pages, v_pages = k[int(layer)], v[int(layer)]  # the slice is outside the timed call
    try:
        fn = jax.jit(jpa.paged_attention)
        sec = time_call(fn, q, k_pages, v_pages, page_table, kv_lens)
        return dict(jax_paged_us=sec * 1e6, jax_paged_kv_gb_s=batch.kv_bytes / sec / 1e9)
    except Exception as e:
        return dict(jax_paged_error=f"{type(e).__name__}: {e}"[:1000])


def bench_mixed() -> dict:
    q_lens = [512] * 4 + [1] * 60
    kv_lens = [512] * 4 + [1024] * 60
    batch = make_batch(q_lens, kv_lens, pad_tokens=4, **LLAMA_8B)
    ours = time_call(kernel_fn(), *batch.args, iters=20, reps=9)
    ref = time_call(reference_fn, *batch.args, iters=3, reps=3)
    row = dict(case="mixed 4x512 prompts + 60x1024 increments", us=ours * 1e6, reference_us=ref * 1e6,
               speedup_vs_reference=ref / ours, kv_gb_s=batch.kv_bytes / ours / 1e9)
    inc = make_batch([1] * 60, [1024] * 60, **LLAMA_8B)
    row["increments_only_us"] = time_call(kernel_fn(), *inc.args, iters=20, reps=9) * 1e6
    row.update(jax_paged_attention(inc))
    print("mixed", row, flush=True)
    return row


def bench_prefill() -> dict:
    batch = make_batch([512] * 8, [512] * 8, **LLAMA_8B)
    sec = time_call(kernel_fn(), *batch.args, iters=20, reps=9)
    row = dict(case="prefill 8x512 causal", us=sec * 1e6, tflops=batch.flops / sec / 1e12)
    try:  # cuDNN flash attention on the same (dense) problem, as a yardstick
        q = batch.args[0].reshape(8, 512, 32, 128)
        kd = jax.random.normal(jax.random.key(1), (8, 512, 8, 128), jnp.bfloat16)
        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                       implementation="cudnn"))
        dense = time_call(fn, q, kd, kd)
        row.update(cudnn_dense_us=dense * 1e6, cudnn_tflops=batch.flops / dense / 1e12)
    except Exception as e:
        row["cudnn_error"] = f"{type(e).__name__}: {e}"[:500]
    print("prefill", row, flush=True)
    return row


def sweep(deadline: float) -> list[dict]:
    """Time a few tiles per workload; stops at the deadline. Feeds the kernel's tile table."""
    Tile = ra.Tile
    work = [
        ("decode 64x1024 d128 g4", make_batch([1] * 64, [1024] * 64, **LLAMA_8B), "short",
         [Tile(16, bk, w, s) for bk in (32, 64, 128)
          for w, s in ((2, 3), (4, 2), (4, 3), (4, 4), (8, 3))]),
        ("decode 128x1024 d64 g3", make_batch([1] * 128, [1024] * 128, **SMOLLM2), "short",
         [Tile(16, bk, w, s) for bk in (64, 128) for w, s in ((2, 3), (4, 2), (4, 3), (4, 4))]),
        ("prefill 8x512 d128 g4", make_batch([512] * 8, [512] * 8, **LLAMA_8B), "long",
         [Tile(r, bk, w, s) for r in (64, 128) for bk in (32, 64) for w, s in ((4, 2), (8, 2), (8, 3))]),
        ("prefill 8x512 d64 g3", make_batch([512] * 8, [512] * 8, **SMOLLM2), "long",
         [Tile(r, bk, w, s) for r in (64, 128) for bk in (64, 128) for w, s in ((4, 2), (8, 2))]),
    ]
    few = [("decode 8x2048 d128 g4", make_batch([1] * 8, [2048] * 8, **LLAMA_8B)),
           ("decode 64x1024 d64 g3", make_batch([1] * 64, [1024] * 64, **SMOLLM2)),
           ("decode 64x1024 d128 g4", make_batch([1] * 64, [1024] * 64, **LLAMA_8B))]
    work = [(name, batch, "kv_splits", [1, 2, 4, 8, 16]) for name, batch in few] + work
    rows = []
    for name, batch, which, tiles in work:
        q, k = batch.args[0], batch.args[1]
        base = ra.default_block_sizes(k.shape[-1], k.shape[3], q.shape[1] // k.shape[1], q.dtype)
        for tile in tiles:
            if time.time() > deadline:
                return rows
            sizes = dataclasses.replace(base, **{which: tile})
            row = dict(work=name, **{which: tile if isinstance(tile, int) else dataclasses.asdict(tile)})
            try:
                sec = time_call(kernel_fn(sizes), *batch.args, iters=10, reps=5)
                row.update(us=sec * 1e6, kv_gb_s=batch.kv_bytes / sec / 1e9,
                           tflops=batch.flops / sec / 1e12)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print("sweep", row, flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m orca_jax.bench kernels", )
    parser.add_argument("--out", default=".")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    parser.add_argument("--sweep-seconds", type=float, default=180.0)
    parsed = parser.parse_args(argv)
    os.makedirs(parsed.out, exist_ok=True)
    path = os.path.join(parsed.out, "kernel_bench.json")
    dev = jax.devices()[0]
    result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  backend="pallas-triton", default_tiles={})

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    for shape in (LLAMA_8B, SMOLLM2):
        g = shape["num_heads"] // shape["num_kv_heads"]
        sizes = ra.default_block_sizes(shape["head_dim"], 16, g, jnp.bfloat16)
        result["default_tiles"][f"d{shape['head_dim']} g{g}"] = dataclasses.asdict(sizes)
    start = time.time()
    result["correctness"] = check_correctness()
    save()
    result["copy"] = copy_bandwidth()
    result["copy_gb_s"] = result["copy"]["copy_gb_s"]
    save()
    for key, fn in [("decode", lambda: bench_decode(result["copy_gb_s"] * 1e9)),
                    ("mixed", bench_mixed), ("prefill", bench_prefill)]:
        try:
            result[key] = fn()
        except Exception as e:
            result[key] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        save()
    if parsed.sweep:
        result["sweep"] = sweep(time.time() + parsed.sweep_seconds)
        save()
    result["wall_s"] = time.time() - start
    save()

    print("\n== ragged_attention on", result["device"], "jax", result["jax"])
    print(f"correctness: {sum(r.get('ok', False) for r in result['correctness'])}/"
          f"{len(result['correctness'])} cases within tolerance")
    print(f"copy bandwidth (read + write): {result['copy_gb_s']:.0f} GB/s {result['copy']}")
    for row in result["decode"] if isinstance(result["decode"], list) else [result["decode"]]:
        print(f"{row.get('case')} ({row.get('kv_splits')} splits): {row.get('us', math.nan):.1f} us, "
              f"{row.get('kv_gb_s', math.nan):.0f} GB/s"
              f" ({100 * row.get('frac_of_copy', math.nan):.0f}% of copy); jax paged_attention "
              f"{row.get('jax_paged_us', math.nan):.1f} us")
    m = result["mixed"]
    print(f"{m.get('case')}: {m.get('us', math.nan):.1f} us, reference "
          f"{m.get('reference_us', math.nan):.0f} us ({m.get('speedup_vs_reference', math.nan):.1f}x); "
          f"increments only "
          f"{m.get('increments_only_us', math.nan):.1f} us vs jax paged_attention "
          f"{m.get('jax_paged_us', math.nan):.1f} us")
    p = result["prefill"]
    print(f"{p.get('case')}: {p.get('us', math.nan):.1f} us, {p.get('tflops', math.nan):.0f} TFLOP/s"
          f" (cuDNN dense {p.get('cudnn_tflops', math.nan):.0f})")


if __name__ == "__main__":
    main()
