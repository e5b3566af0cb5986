"""`bench kernel`: the ragged paged attention kernel, checked against its reference, then timed.

Its contract is the runner's, per layer: ragged_attention(q, k_cache, v_cache, cu_q_lens, kv_lens,
page_table, num_seqs) with caches [KVH, pages, page_size, D]. Sections, saved as each ends:
- check: mixed batches (prompts, chunks, increments, padding) over several head shapes, page sizes and
  dtypes, on caches poisoned with NaN where no request may read (pages nobody owns, slots past each
  request's length): the kernel against ragged_attention_reference;
- copy: the device's copy bandwidth (a jax elementwise pass, and torch's memcpy where there is one);
- decode: one token per request at each --contexts x --batch-sizes, as a fraction of that bandwidth
  (K/V bytes a perfect kernel reads once / time), and with --jax-paged beside jax's own Pallas
  paged_attention;
- prefill: --prefill-batch causal prompts of --prefill-len tokens, TFLOP/s, against cuDNN's flash
  attention (jax.nn.dot_product_attention) on the same dense problem;
- sweep (--sweep): a grid of tiles per workload, which is what the kernel's tile table was picked from.
Timings are jax-side: the median of back-to-back calls, so host dispatch overlaps device work.

On an H100, every case of the llama-8b shape:  python -m orca_jax.bench kernel --result-dir DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench import roofline
from orca_jax.bench.datasets import int_list
from orca_jax.bench.harness import Results, add_result_arguments
from orca_jax.bench.roofline import time_call
from orca_jax.kernels import ragged_attention as ra

# (name, heads, KV heads, head dim, page size, dtype, q_lens, kv_lens, padding tokens, padding slots)
CHECK_CASES = (
    ("mixed gqa4 d128 p16 bf16", 32, 8, 128, 16, "bfloat16", [37, 1, 100, 20, 1, 1, 3], [37, 77, 100, 75, 1, 300, 9], 5, 2),
    ("mixed gqa4 d128 p16 f32", 32, 8, 128, 16, "float32", [37, 1, 100, 20, 1, 1, 3], [37, 77, 100, 75, 1, 300, 9], 5, 2),
    ("mixed gqa3 d64 p16 bf16", 9, 3, 64, 16, "bfloat16", [130, 1, 1, 7], [130, 513, 64, 40], 3, 1),
    ("mixed mha d128 p1 f32", 4, 4, 128, 1, "float32", [33, 1, 2], [50, 65, 2], 0, 0),
    ("mixed gqa8 d64 p64 bf16", 16, 2, 64, 64, "bfloat16", [70, 1, 1], [200, 129, 64], 2, 1),
    ("decode gqa4 d128 p16 bf16 (K/V splits)", 32, 8, 128, 16, "bfloat16", [1, 1, 1], [1000, 77, 1], 1, 1),
    ("decode gqa3 d64 p16 f32 (K/V splits)", 9, 3, 64, 16, "float32", [1, 1, 2], [1000, 500, 333], 0, 0),
)
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-heads", type=int, default=32, help="the timed shape (default llama-8b's)")
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--contexts", type=int_list, default=[1024, 2048, 8192], help="decode K/V lengths")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--check", choices=["all", "timed-shape", "none"], default="all",
                        help="correctness cases: all, one of the timed shape, or none")
    parser.add_argument("--jax-paged", action="store_true",
                        help="also time jax's own Pallas paged_attention on each decode case (a compile each)")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    parser.add_argument("--sweep-seconds", type=float, default=180.0)
    parser.add_argument("--interpret", action="store_true", help="run the kernel interpreted (CPU; default off GPU)")
    add_result_arguments(parser)


@dataclasses.dataclass
class Batch:
    args: tuple  # ragged_attention's positional arguments
    kv_bytes: int  # K and V bytes a perfect kernel reads once
    flops: float  # causal attention FLOPs (QK^T and PV)


def make_batch(q_lens, kv_lens, *, num_heads, num_kv_heads, head_dim, page_size=16, dtype="bfloat16",
               pad_tokens=0, pad_seqs=0, spare_pages=0, seed=0) -> Batch:
    """A ragged batch with its pages in scattered order (page 0 is the scratch page); K/V random."""
    rng = np.random.default_rng(seed)
    pages = [-(-k // page_size) for k in kv_lens]
    num_pages = 1 + sum(pages) + spare_pages
    order = rng.permutation(np.arange(1, 1 + sum(pages))).astype(np.int32)
    page_table = np.zeros((len(q_lens) + pad_seqs, max(pages)), np.int32)  # i32[S, P]
    starts = np.cumsum([0] + pages)
    for s, n in enumerate(pages):
        page_table[s, :n] = order[starts[s]:starts[s] + n]
    cu = np.zeros(len(page_table) + 1, np.int32)  # i32[S + 1]; padding slots have no tokens
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    kv = np.zeros(len(page_table), np.int32)  # i32[S]
    kv[:len(kv_lens)] = kv_lens
    kq, kk, kv_key = jax.random.split(jax.random.key(seed), 3)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    q = _normal(kq, (int(cu[-1]) + pad_tokens, num_heads, head_dim), dtype)
    args = (q, _pages(kk, shape, dtype), _pages(kv_key, shape, dtype), jnp.asarray(cu), jnp.asarray(kv),
            jnp.asarray(page_table), jnp.asarray([len(q_lens)], jnp.int32))
    # Query i of a request sees kv - q + i + 1 keys; 4 FLOPs per (query head, key, dim).
    pairs = sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(q_lens, kv_lens))
    return Batch(args, 2 * sum(kv_lens) * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize,
                 4.0 * pairs * num_heads * head_dim)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pages(key, shape, dtype):
    """Random pages, the first 1024 repeated over the rest: a large cache (8 GiB at 256 x 8k)
    without drawing every value; the kernel still reads each page from its own address."""
    block = _normal(key, (shape[0], min(shape[1], 1024), *shape[2:]), dtype)
    return jnp.tile(block, (1, -(-shape[1] // block.shape[1]), 1, 1))[:, :shape[1]]


def poisoned(args):
    """NaN in pages no request owns and in the slots past each request's K/V length."""
    q, k, v, cu, kv_lens, page_table, num_seqs = args
    num_pages, page_size = k.shape[1], k.shape[2]
    bad = np.ones((num_pages, page_size), bool)
    for pages, n in zip(np.asarray(page_table)[:int(num_seqs[0])], np.asarray(kv_lens)):
        for j in range(-(-int(n) // page_size)):
            bad[pages[j], :min(page_size, int(n) - j * page_size)] = False
    mask = jnp.asarray(bad)[None, :, :, None]
    return (q, jnp.where(mask, jnp.nan, k), jnp.where(mask, jnp.nan, v), cu, kv_lens, page_table, num_seqs)


def check(cases, interpret: bool) -> list[dict]:
    rows = []
    for name, heads, kv_heads, dim, page_size, dtype, q_lens, kv_lens, pad_t, pad_s in cases:
        row = {"case": name, "tolerance": TOLERANCE[dtype]}
        try:
            batch = make_batch(q_lens, kv_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                               page_size=page_size, dtype=dtype, pad_tokens=pad_t, pad_seqs=pad_s, spare_pages=2)
            out = ra.ragged_attention(*poisoned(batch.args), interpret=interpret).astype(jnp.float32)
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(ra.ragged_attention_reference)(*batch.args).astype(jnp.float32)
            row["max_abs_err"] = float(jnp.max(jnp.abs(out - ref)))
            row["rel_l2_err"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            row["ok"] = bool(jnp.all(jnp.isfinite(out))) and row["max_abs_err"] <= row["tolerance"]
        except Exception as err:  # one broken case must not hide the others
            row |= {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
            traceback.print_exc()
        print("check", row, flush=True)
        rows.append(row)
    return rows


def copy_bandwidth() -> dict:
    """Device-to-device read + write bytes per second: jax's elementwise pass, and torch's memcpy
    (timed with CUDA events by triton.testing.do_bench) where torch sees a GPU; the higher counts."""
    on_cpu = jax.devices()[0].platform == "cpu"
    result = {"jax_elementwise_gb_s": roofline.copy_bandwidth(64 << 20 if on_cpu else 1 << 30) / 1e9}
    try:
        import torch
        import triton.testing

        src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
        copy = functools.partial(torch.Tensor.copy_, torch.empty_like(src), src)
        ms = triton.testing.do_bench(copy, warmup=50, rep=300, return_mode="median")
        result["memcpy_gb_s"] = 2 * (1 << 30) / (ms * 1e-3) / 1e9
        src = copy = None  # torch's memory back before jax's kernels run
        torch.cuda.empty_cache()
    except Exception as err:  # no torch, no GPU for it: the jax figure stands alone
        result["memcpy_error"] = f"{type(err).__name__}: {err}"[:300]
    result["copy_gb_s"] = max(v for k, v in result.items() if k.endswith("gb_s"))
    return result


def jax_paged_attention(batch: Batch) -> dict:
    """jax's own Pallas GPU paged_attention on the same decode batch and cache."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa

        q, k, v, _, kv_lens, page_table, _ = batch.args
        seconds = time_call(jax.jit(jpa.paged_attention), q, k, v, page_table, kv_lens)
        return {"jax_paged_us": 1e6 * seconds, "jax_paged_kv_gb_s": batch.kv_bytes / seconds / 1e9}
    except Exception as err:
        return {"jax_paged_error": f"{type(err).__name__}: {err}"[:500]}


def decode(args: argparse.Namespace, copy_gb_s: float, kernel, on_row) -> list[dict]:
    rows = []
    shape = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                 page_size=args.page_size, dtype=args.dtype)
    for context in sorted(args.contexts):
        for batch_size in sorted(args.batch_sizes):
            row = {"context": context, "batch_size": batch_size}
            try:
                batch = make_batch([1] * batch_size, [context] * batch_size, **shape)
                seconds = time_call(kernel, *batch.args, iters=20, reps=9)
                row |= {"us": 1e6 * seconds, "kv_gb_s": batch.kv_bytes / seconds / 1e9,
                        "frac_of_copy": batch.kv_bytes / seconds / 1e9 / copy_gb_s}
                if args.jax_paged:
                    row |= jax_paged_attention(batch)
                del batch
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
                traceback.print_exc()
            print("decode", row, flush=True)
            rows.append(row)
            on_row(rows)
    return rows


def prefill(args: argparse.Namespace, kernel) -> dict:
    n, length = args.prefill_batch, args.prefill_len
    batch = make_batch([length] * n, [length] * n, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                       head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype)
    seconds = time_call(kernel, *batch.args, iters=20, reps=9)
    row = {"batch": n, "length": length, "us": 1e6 * seconds, "tflops": batch.flops / seconds / 1e12}
    q = batch.args[0].reshape(n, length, args.num_heads, args.head_dim)
    kv = _normal(jax.random.key(1), (n, length, args.num_kv_heads, args.head_dim), args.dtype)
    for implementation in ("cudnn", "xla"):  # cuDNN's flash attention; XLA's where cuDNN cannot run
        try:
            fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation))
            dense = time_call(fn, q, kv, kv)
            row |= {"dense": implementation, "dense_us": 1e6 * dense, "dense_tflops": batch.flops / dense / 1e12}
            break
        except Exception as err:
            row[f"{implementation}_error"] = f"{type(err).__name__}: {err}"[:500]
    print("prefill", row, flush=True)
    return row


def sweep(args: argparse.Namespace, deadline: float, interpret: bool) -> list[dict]:
    """A few tiles per workload (decode: the short pass's tile and K/V splits; prefill: the long pass's)."""
    shape = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                 page_size=args.page_size, dtype=args.dtype)
    decode_batch = make_batch([1] * 64, [1024] * 64, **shape)
    prefill_batch = make_batch([512] * 8, [512] * 8, **shape)
    grid = [("decode 64x1024", decode_batch, "kv_splits", [1, 2, 4, 8, 16]),
            ("decode 64x1024", decode_batch, "short", [ra.Tile(16, bk, w, s) for bk in (32, 64, 128)
                                                        for w, s in ((2, 3), (4, 2), (4, 3), (4, 4), (8, 3))]),
            ("prefill 8x512", prefill_batch, "long", [ra.Tile(r, bk, w, s) for r in (64, 128) for bk in (32, 64)
                                                      for w, s in ((4, 2), (8, 2), (8, 3))])]
    base = ra.default_block_sizes(args.head_dim, args.page_size, args.num_heads // args.num_kv_heads, args.dtype)
    rows = []
    for work, batch, field, values in grid:
        for value in values:
            if time.time() > deadline:
                return rows
            sizes = dataclasses.replace(base, **{field: value})
            row = {"work": work, field: value if isinstance(value, int) else dataclasses.asdict(value)}
            try:
                fn = jax.jit(functools.partial(ra.ragged_attention, block_sizes=sizes, interpret=interpret))
                seconds = time_call(fn, *batch.args, iters=10, reps=5)
                row |= {"us": 1e6 * seconds, "kv_gb_s": batch.kv_bytes / seconds / 1e9,
                        "tflops": batch.flops / seconds / 1e12}
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            print("sweep", row, flush=True)
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> Results:
    results = Results("kernel", args, f"attention-h{args.num_heads}-kv{args.num_kv_heads}-d{args.head_dim}")
    interpret = args.interpret or jax.devices()[0].platform != "gpu"
    kernel = jax.jit(functools.partial(ra.ragged_attention, interpret=interpret))
    group = args.num_heads // args.num_kv_heads
    results["default_tiles"] = dataclasses.asdict(ra.default_block_sizes(args.head_dim, args.page_size, group, args.dtype))
    timed = ("timed shape", args.num_heads, args.num_kv_heads, args.head_dim, args.page_size, args.dtype,
             [9, 1, 3], [20, 40, 3], 2, 1)
    cases = {"all": CHECK_CASES, "timed-shape": (timed,), "none": ()}[args.check]
    results.section("check", check(cases, interpret))
    results.section("copy", copy_bandwidth())
    # Decode last, largest last: 256 x 8k is a cache of 2^31 elements per array, where a kernel that
    # indexes with 32 bits would fault and take the process's GPU context with it.
    for name, section in (("prefill", lambda: prefill(args, kernel)),
                          ("decode", lambda: decode(args, results["copy"]["copy_gb_s"], kernel,
                                                    lambda rows: results.section("decode", rows)))):
        try:
            results.section(name, section())
        except Exception as err:
            results.section(name, {"error": f"{type(err).__name__}: {err}"[:2000]})
            traceback.print_exc()
    if args.sweep:
        results.section("sweep", sweep(args, time.time() + args.sweep_seconds, interpret))
    failed = [r["case"] for r in results["check"] if not r["ok"]]
    print(f"check: {len(results['check']) - len(failed)}/{len(results['check'])} within tolerance"
          + (f"; failed: {failed}" if failed else ""))
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    decode_rows = result.get("decode") if isinstance(result.get("decode"), list) else []
    prefill_row = result.get("prefill") if isinstance(result.get("prefill"), dict) else {}
    return {"check": [{k: r.get(k) for k in ("case", "max_abs_err", "tolerance", "ok", "error")}
                      for r in result.get("check", [])],
            "decode (fraction of copy bandwidth)": [
                {"context": r["context"], "batch": r["batch_size"], "us": r.get("us"), "GB/s": r.get("kv_gb_s"),
                 "of copy": r.get("frac_of_copy"), "jax paged_attention us": r.get("jax_paged_us"),
                 "error": r.get("error")} for r in decode_rows],
            "prefill vs dense attention": [{k: prefill_row.get(k) for k in (
                "batch", "length", "us", "tflops", "dense", "dense_us", "dense_tflops", "error")}] if prefill_row else []}
