"""Compile every bucket an engine can meet before timing starts, in parallel, and keep the executables.

The runner compiles lazily (one program per bucket on first use), which would put compile time
inside the measurements. Here each bucket's forward and sampling program is lowered and compiled
ahead of time on a thread pool (XLA compiles outside the GIL), and the runner's two jitted
functions are wrapped so a call whose shapes match a compiled bucket runs that executable directly.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.engine import Engine
from orca_jax.models.attention import AttentionMetadata
from orca_jax.sampling import SamplingArrays


class _Precompiled:
    """Calls a compiled executable when the arguments' key matches one, else the jitted function."""

    def __init__(self, jitted, key_fn, compiled: dict):
        self.jitted, self.key_fn, self.compiled = jitted, key_fn, compiled

    def __call__(self, *args):
        fn = self.compiled.get(self.key_fn(*args))
        return self.jitted(*args) if fn is None else fn(*args)

    def __getattr__(self, name):  # _cache_size() and friends
        return getattr(self.jitted, name)


def _pow2s(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return out + [hi]


def bucket_shapes(engine: Engine, max_kv_tokens: int) -> list[tuple[int, int, int]]:
    """Every (T, S, P) bucket an iteration can land in when no sequence exceeds max_kv_tokens."""
    buckets = engine.buckets
    max_pages = -(-max_kv_tokens // engine.runner.page_size)
    return sorted({buckets.bucket(t, min(t, buckets.max_seqs), p)
                   for t in _pow2s(8, buckets.max_tokens) for p in _pow2s(4, max(max_pages, 4))})


def precompile(engine: Engine, max_kv_tokens: int, threads: int | None = None) -> dict:
    """Compile all buckets' programs; returns what was compiled and how long it took."""
    runner = engine.runner
    shapes = bucket_shapes(engine, max_kv_tokens)
    vocab = runner.config.vocab_size
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

    def lower_forward(t, s, p):
        meta = AttentionMetadata(cu_q_lens=i32(s + 1), kv_lens=i32(s), page_table=i32(s, p),
                                 slot_mapping=i32(t), num_seqs=i32(1))
        return runner._forward.lower(runner.params, runner.cache, i32(t), i32(t), meta, i32(s)).compile()

    def lower_sample(s):
        sampling = SamplingArrays(jax.ShapeDtypeStruct((s,), jnp.float32), i32(s),
                                  jax.ShapeDtypeStruct((s,), jnp.float32),
                                  jax.ShapeDtypeStruct((s,), jnp.uint32), i32(s))
        # Benchmarks run greedy: the all-greedy sampler (static flag True) is the one they call.
        return runner._sample.lower(jax.ShapeDtypeStruct((s, vocab), jnp.float32), sampling, 0, True).compile()

    start = time.perf_counter()
    sizes = sorted({s for _, s, _ in shapes})
    with concurrent.futures.ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        forwards = {shape: pool.submit(lower_forward, *shape) for shape in shapes}
        samples = {s: pool.submit(lower_sample, s) for s in sizes}
        forward_exec = {shape: f.result() for shape, f in forwards.items()}
        sample_exec = {(s, 0, True): f.result() for s, f in samples.items()}
    seconds = time.perf_counter() - start
    jitted_forward = getattr(runner._forward, "jitted", runner._forward)
    jitted_sample = getattr(runner._sample, "jitted", runner._sample)
    runner._forward = _Precompiled(
        jitted_forward, lambda params, cache, tok, pos, meta, li: (tok.shape[0], *meta.page_table.shape),
        forward_exec)
    # The compiled sampler takes the static k and greedy flag out of its signature: drop them.
    sample_exec = {key: (lambda exe: lambda logits, sampling, k, greedy: exe(logits, sampling))(exe)
                   for key, exe in sample_exec.items()}
    runner._sample = _Precompiled(jitted_sample, lambda logits, sampling, k, greedy: (logits.shape[0], k, greedy),
                                  sample_exec)
    runner.compiled_shapes.update(("forward", *shape) for shape in shapes)
    runner.compiled_shapes.update(("sample", s, 0, True) for s in sizes)
    # One run of every forward program, so first-call costs (autotuning, module load) are paid here.
    for t, s, p in shapes:
        np.asarray(runner.execute(_empty_batch(t, s, p)))
    return {"num_forward_programs": len(shapes), "num_sample_programs": len(sizes),
            "compile_s": seconds, "total_s": time.perf_counter() - start,
            "shapes": [list(x) for x in shapes]}


def _empty_batch(t: int, s: int, p: int):
    """An all-padding batch of one bucket: no live sequence, every token writes to scratch page 0."""
    from orca_jax.batch import RaggedBatch
    z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
    return RaggedBatch(token_ids=z(t), positions=z(t), slot_mapping=z(t), cu_q_lens=z(s + 1), kv_lens=z(s),
                       page_table=z(s, p), num_seqs=z(1), logits_indices=z(s),
                       temperature=z(s, dtype=np.float32), top_k=z(s), top_p=np.ones(s, np.float32),
                       seed=z(s, dtype=np.uint32), step=z(s), num_top_logprobs=0, all_greedy=True, num_real_tokens=0,
                       num_real_seqs=0)
