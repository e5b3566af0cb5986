"""Correctness checks run on the GPU before anything is timed: kernel vs jnp reference, engine vs engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.kernels import ragged_attention as ragged


def attention_check(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                    dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """The Pallas kernel against the jnp reference on one mixed batch (prompts, chunks, increments)."""
    q_lens = [1, 1, 37, 5, 128, 1, 300, 1]
    kv_lens = [50, 300, 37, 100, 200, 17, 300, 640]
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-k // page_size) for k in kv_lens)
    num_pages = sum(-(-k // page_size) for k in kv_lens) + 1
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = np.zeros((len(q_lens), pages_per_seq), np.int32)
    cursor = 0
    for s, k in enumerate(kv_lens):
        n = -(-k // page_size)
        table[s, :n] = order[cursor:cursor + n]
        cursor += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + 11  # some padding rows
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (num_tokens, num_heads, head_dim), dtype)
    shape = (1, num_kv_heads, num_pages, page_size, head_dim)
    k_cache = jax.random.normal(keys[1], shape, dtype)
    v_cache = jax.random.normal(keys[2], shape, dtype)
    args = (q, k_cache, v_cache, jnp.int32(0), jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(table), jnp.asarray([len(q_lens)], jnp.int32))
    interpret = jax.devices()[0].platform != "gpu"  # CPU tests run the kernel interpreted
    out = np.asarray(ragged.ragged_attention(*args, interpret=interpret).astype(jnp.float32))
    ref = np.asarray(ragged.ragged_attention_reference(*args).astype(jnp.float32))
    live = int(cu[-1])
    err = np.abs(out[:live] - ref[:live])
    return {"max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
            "padding_rows_zero": bool(np.all(out[live:] == 0)), "ok": bool(err.max() < 5e-2)}


def token_agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    """How often two engines' greedy outputs agree (bf16 near-ties can flip an argmax)."""
    same = sum(a[k] == b[k] for k in a)
    first_diff = []
    for k in a:
        diff = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), None)
        if diff is not None:
            first_diff.append(diff)
    return {"requests": len(a), "identical": same,
            "first_token_identical": sum(a[k][:1] == b[k][:1] for k in a),
            "first_divergence_positions": first_diff}


def dispatch_check(engine, shapes=((8, 8, 64), (128, 128, 64), (2048, 128, 64)), reps: int = 10) -> list[dict]:
    """Does runner.execute return before the device finishes? For all-padding batches of a few buckets
    (the matmuls run on every padded row, so the device work is real), the time for execute() to
    return vs the time until its result is ready, back to back as the engine runs them."""
    import time

    from orca_jax.batch import empty_batch
    runner = engine.runner
    rows = []
    for t, s, p in shapes:
        batch = empty_batch(t, s, p)
        np.asarray(runner.execute(batch))
        dispatch = total = 0.0
        for _ in range(reps):
            start = time.perf_counter()
            out = runner.execute(batch)
            dispatch += time.perf_counter() - start
            np.asarray(out)
            total += time.perf_counter() - start
        rows.append({"bucket": [t, s, p], "dispatch_ms": 1e3 * dispatch / reps, "total_ms": 1e3 * total / reps}
                    | _split_dispatch(runner, batch, reps))
    return rows


def _split_dispatch(runner, batch, reps: int) -> dict:
    """The same, for the forward program alone and the sampling program alone."""
    import time

    argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))  # sampling without the greedy lax.cond
    fwd = fwd_total = smp = smp_total = chained = plain = 0.0
    logits = runner.forward(batch)
    np.asarray(argmax(logits))  # compile outside the timing
    for _ in range(reps):
        start = time.perf_counter()
        logits = runner.forward(batch)
        fwd += time.perf_counter() - start
        logits.block_until_ready()
        fwd_total += time.perf_counter() - start
        start = time.perf_counter()
        out = runner.sample(logits, batch)
        smp += time.perf_counter() - start
        np.asarray(out)
        smp_total += time.perf_counter() - start
        # Dispatched while the forward still runs, as the engine does: which one waits for it?
        logits = runner.forward(batch)
        start = time.perf_counter()
        out = runner.sample(logits, batch)
        chained += time.perf_counter() - start
        np.asarray(out)
        logits = runner.forward(batch)
        start = time.perf_counter()
        out = argmax(logits)
        plain += time.perf_counter() - start
        np.asarray(out)
    ms = lambda x: 1e3 * x / reps
    return {"forward_dispatch_ms": ms(fwd), "forward_total_ms": ms(fwd_total),
            "sample_dispatch_ms": ms(smp), "sample_total_ms": ms(smp_total),
            "sample_dispatch_behind_forward_ms": ms(chained), "argmax_dispatch_behind_forward_ms": ms(plain)}
