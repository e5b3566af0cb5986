"""Device time of the sampling programs' parts at the ORCA trace's widest batch (S = 128 rows, Llama 3's
128,256-token vocabulary): plain sampling with and without top logprobs, logits processing (mask,
logit table, penalties) alone, the count update, the fill, and the processed program whole.

    PYTHONPATH=. python benchmarks/probes/penalty_cost.py   (penalty_cost.json: on an H100)
"""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.sample.mode import FILL_ENTRIES, FILL_RESETS, SampleMode
from orca_jax.sample.ops.penalties import LogitsArrays, count_sampled, empty_tables, fill_tables, process_logits
from orca_jax.sample.ops.sampling import SamplingArrays
from orca_jax.sample.sampler import sample_plain, sample_processed

S, V, W, K = 128, 128256, 8, 20
rng = np.random.default_rng(0)
logits = jnp.asarray(rng.standard_normal((S, V), np.float32) * 4)
params = SamplingArrays(jnp.full(S, 0.8), jnp.full(S, 50, jnp.int32), jnp.full(S, 0.95), jnp.zeros(S),
                        jnp.arange(S, dtype=jnp.uint32), jnp.zeros(S, jnp.int32))
arrays = LogitsArrays(jnp.full(S, 0.5), jnp.full(S, 0.5), jnp.full(S, 1.1), jnp.arange(S, dtype=jnp.int32),
                      jnp.full(S, -1, jnp.int32), jnp.full((S, W), V, jnp.int32), jnp.zeros((S, W)),
                      jnp.full((S, W), -1, jnp.int32), jnp.full((S, -(-V // 32)), -1, jnp.int32))
tables = empty_tables(S, V)
last = jnp.zeros(S, jnp.int32)
unroll = jax.devices()[0].platform == "gpu"


def timed(fn, *args, n=30):
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / n


plain = jax.jit(sample_plain, static_argnums=(2, 3, 4, 5))
processed = jax.jit(sample_processed, static_argnums=(5, 6, 7, 8), donate_argnums=(3,))


def timed_donating(k, n=30):
    """The processed program as the sampler runs it: the tables donated and carried over."""
    state = empty_tables(S, V)
    for i in range(n + 1):
        if i == 1:
            jax.block_until_ready(state)
            start = time.perf_counter()
        _, _, state = processed(logits, params, arrays, state, last, SampleMode.SAMPLE, k, S, unroll)
    jax.block_until_ready(state)
    return 1e3 * (time.perf_counter() - start) / n


rows = {
    "plain_sample_k0_ms": timed(plain, logits, params, SampleMode.SAMPLE, 0, S, unroll),
    "plain_sample_k20_ms": timed(plain, logits, params, SampleMode.SAMPLE, K, S, unroll),
    "plain_greedy_k0_ms": timed(plain, logits, params, SampleMode.GREEDY, 0, S, unroll),
    "process_logits_ms": timed(jax.jit(process_logits), logits, arrays, tables, last),
    "count_sampled_ms": timed(jax.jit(count_sampled), tables, arrays.penalty_slot, jnp.zeros(S, jnp.int32)),
    "fill_ms": timed(jax.jit(fill_tables), tables, jnp.arange(FILL_RESETS, dtype=jnp.int32),
                     jnp.zeros((FILL_ENTRIES, 3), jnp.int32)),
    "processed_sample_k20_ms": timed_donating(K),
    "processed_sample_k0_ms": timed_donating(0),
}
print(json.dumps({"device": jax.devices()[0].device_kind, "S": S, "V": V} | rows, indent=1))
