"""On-device sampling: greedy, seeds, batch independence, and the definitions of top-k and top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.sampling import SamplingArrays, pack, sample

VOCAB = 32


def _arrays(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0):
    full = lambda v, dt: jnp.full((n,), v, dt)
    return SamplingArrays(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                          full(seed, jnp.uint32), full(step, jnp.int32))


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(1), (1, VOCAB), jnp.float32) * 2.0


def _draws(logits, n, **kw):
    """n independent draws from one row: same seed, steps 0..n-1 (as a request generating n tokens)."""
    batch = jnp.repeat(logits, n, axis=0)
    params = _arrays(n, **kw)._replace(step=jnp.arange(n, dtype=jnp.int32))
    return np.asarray(jax.jit(sample, static_argnums=2)(batch, params, 0).token_ids)


def test_greedy_is_argmax_and_logprob_is_log_softmax(logits):
    out = sample(logits, _arrays(1, temperature=0.0), 3)
    assert int(out.token_ids[0]) == int(jnp.argmax(logits[0]))
    expected = jax.nn.log_softmax(logits[0])
    np.testing.assert_allclose(out.logprobs[0], expected[out.token_ids[0]], rtol=1e-6)
    np.testing.assert_allclose(out.top_logprobs[0], jnp.sort(expected)[::-1][:3], rtol=1e-6)


def test_all_greedy_program_equals_the_general_one_on_greedy_rows():
    logits = jax.random.normal(jax.random.key(3), (5, VOCAB))
    params = _arrays(5, temperature=0.0)
    fast, general = sample(logits, params, 2, all_greedy=True), sample(logits, params, 2)
    for a, b in zip(fast, general):
        np.testing.assert_array_equal(a, b)


def test_same_seed_same_tokens_whatever_shares_the_batch(logits):
    """Row 0 has seed 7 at step 5; its draw must not change when its neighbours change."""
    alone = sample(logits, _arrays(1, seed=7, step=5), 0).token_ids[0]
    other = jax.random.normal(jax.random.key(2), (3, VOCAB))
    batch = jnp.concatenate([logits, other])
    params = SamplingArrays(jnp.array([1.0, 0.0, 0.7, 1.3]), jnp.array([0, 0, 5, 0], jnp.int32),
                            jnp.array([1.0, 1.0, 1.0, 0.5]), jnp.array([7, 1, 2, 3], jnp.uint32),
                            jnp.array([5, 0, 9, 2], jnp.int32))
    assert int(sample(batch, params, 0).token_ids[0]) == int(alone)
    assert int(sample(batch[::-1], params._replace(**{f: getattr(params, f)[::-1] for f in params._fields}),
                      0).token_ids[3]) == int(alone)


def test_different_steps_give_different_draws(logits):
    draws = _draws(logits, 200, temperature=5.0)
    assert len(set(draws.tolist())) > 5


def test_top_k_only_draws_the_k_most_likely(logits):
    allowed = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    draws = _draws(logits, 400, temperature=3.0, top_k=3)
    assert set(draws.tolist()) == allowed  # every one of the 3 appears at such a high temperature


def test_top_p_keeps_the_smallest_prefix_reaching_p(logits):
    probs = np.asarray(jax.nn.softmax(logits[0]))
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    allowed = set(order[mass_before < 0.6].tolist())
    draws = _draws(logits, 400, temperature=1.0, top_p=0.6)
    assert set(draws.tolist()) <= allowed
    assert len(set(draws.tolist())) >= min(len(allowed), 2)


def test_temperature_one_matches_the_distribution(logits):
    """Chi-square-style check on the empirical frequencies (fixed seed, so deterministic)."""
    n = 4000
    draws = _draws(logits, n, temperature=1.0)
    probs = np.asarray(jax.nn.softmax(logits[0]))
    counts = np.bincount(draws, minlength=VOCAB)
    likely = probs > 0.02
    expected = probs[likely] * n
    chi2 = (((counts[likely] - expected) ** 2) / expected).sum()
    assert chi2 < 3 * likely.sum(), (chi2, likely.sum())


def test_pack_round_trips_through_one_int_array(logits):
    out = sample(jnp.repeat(logits, 2, axis=0), _arrays(2, temperature=0.0), 4)
    packed = np.asarray(pack(out))
    assert packed.dtype == np.int32 and packed.shape == (2, 2 + 2 * 4)
    np.testing.assert_array_equal(packed[:, 0], out.token_ids)
    np.testing.assert_array_equal(packed[:, 1].view(np.float32), out.logprobs)
    np.testing.assert_array_equal(packed[:, 6:].view(np.float32), out.top_logprobs)
