"""On-device sampling: greedy, seeds, batch independence, and top-k / top-p / min-p without a sort
against the sorted definitions (a numpy reference, transformers' warpers, the former full-sort sampler)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.sample.mode import TOP_K_CANDIDATES, SampleMode
from orca_jax.sample.ops.sampling import (SamplingArrays, candidate_keep, order_key, pack, radix_threshold, sample,
                                          top_k_candidates, vocab_keep)

VOCAB = 32
BIG_VOCAB = 8192  # 256 blocks: the candidate search prunes (more blocks than TOP_K_CANDIDATES)


def _arrays(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0):
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return SamplingArrays(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                          full(min_p, jnp.float32), full(seed, jnp.uint32), full(step, jnp.int32))


_sample = jax.jit(sample, static_argnums=(2, 3, 5))


@pytest.fixture(scope="module")
def logits():
    return jax.random.normal(jax.random.key(1), (1, VOCAB), jnp.float32) * 2.0


def _draws(logits, n, mode, **kw):
    """n independent draws from one row: same seed, steps 0..n-1 (as a request generating n tokens)."""
    batch = jnp.repeat(logits, n, axis=0)
    params = _arrays(n, **kw)._replace(step=jnp.arange(n, dtype=jnp.int32))
    return np.asarray(_sample(batch, params, mode, 0, None, True).token_ids)


def reference_keep(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """(kept bool[V], probabilities f64[V]) by the sorted definitions, in float64 (vLLM's order:
    temperature, min_p, top_k, top_p over what min_p and top_k kept)."""
    s = np.asarray(logits, np.float64) / temperature
    p = np.exp(s - s.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-s, kind="stable")
    if top_k:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    sorted_q = q[order]
    keep[order[(np.cumsum(sorted_q) - sorted_q) >= top_p]] = False
    q = np.where(keep, q, 0.0)
    return keep, q / q.sum()


def _full_sort_keep(scaled, top_k, top_p):
    """The former sampler's kept set: the whole vocabulary sorted, top-k and top-p on the sorted row."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled)
    probs = jax.nn.softmax(scaled[order])
    keep_k = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
    keep_p = (jnp.cumsum(probs) - probs) < top_p
    return jnp.zeros(vocab, bool).at[order].set(keep_k & keep_p)


@functools.partial(jax.jit, static_argnums=(4,))
def _ours_keep(scaled, top_k, top_p, min_p, search):
    """Our kept set over the vocabulary: from the candidates for a small top_k, else the search."""
    values, ids = top_k_candidates(scaled, min(TOP_K_CANDIDATES, scaled.shape[-1]))
    from_candidates = jnp.zeros(scaled.shape[-1], bool).at[ids].set(candidate_keep(values, top_k, top_p, min_p),
                                                                    mode="drop")
    return from_candidates if not search else vocab_keep(scaled, top_k, top_p, min_p, SampleMode.SEARCH_TOP_K)


def test_greedy_is_argmax_and_logprob_is_log_softmax(logits):
    out = sample(logits, _arrays(1, temperature=0.0), SampleMode.GREEDY, 3)
    assert int(out.token_ids[0]) == int(jnp.argmax(logits[0]))
    expected = jax.nn.log_softmax(logits[0])
    np.testing.assert_allclose(out.logprobs[0], expected[out.token_ids[0]], rtol=1e-6)
    np.testing.assert_allclose(out.top_logprobs[0], jnp.sort(expected)[::-1][:3], rtol=1e-6)


def test_greedy_rows_take_the_argmax_in_every_program():
    logits = jax.random.normal(jax.random.key(3), (5, VOCAB))
    params = _arrays(5, temperature=0.0, top_p=0.5)
    results = [_sample(logits, params, mode, 2, None, True) for mode in SampleMode]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vocab, k", [(1000, 1), (1000, 7), (BIG_VOCAB, 50), (BIG_VOCAB + 5, 128), (40, 40)])
def test_top_k_candidates_are_the_k_largest(vocab, k):
    x = np.array(jax.random.normal(jax.random.key(vocab + k), (3, vocab)))
    x[0, ::3] = -np.inf  # masked tokens
    x[1, :vocab // 2] = x[1, vocab // 2:vocab // 2 * 2]  # ties
    values, ids = top_k_candidates(jnp.asarray(x), k)
    np.testing.assert_array_equal(values, -np.sort(-x, axis=-1)[:, :k])
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), axis=-1), values)
    assert all(len(set(row)) == k for row in np.asarray(ids).tolist())


def test_radix_threshold_finds_the_kth_value_and_the_top_p_mass():
    rng = np.random.default_rng(0)
    x = rng.normal(size=500).astype(np.float32) * 3
    x[:7] = -np.inf
    keys = order_key(jnp.asarray(x))
    for k in (1, 2, 17, 300, 493, 500):
        t = radix_threshold(keys, jnp.ones(500, jnp.int32), jnp.int32(k))
        assert (keys >= t).sum() == k if k <= 493 else (keys >= t).sum() == 500  # ties at -inf: all kept
    q = np.exp(x - x.max())
    q /= q.sum()
    for p in (0.05, 0.5, 0.9, 0.999):
        t = radix_threshold(jax.lax.bitcast_convert_type(jnp.asarray(q), jnp.uint32), jnp.asarray(q), jnp.float32(p))
        kept = q >= jax.lax.bitcast_convert_type(t, jnp.float32)
        sorted_q = np.sort(q)[::-1]
        assert kept.sum() == np.searchsorted(np.cumsum(sorted_q), p) + 1


CASES = [dict(top_k=5), dict(top_k=40, top_p=0.8), dict(top_k=128, top_p=0.95, min_p=0.01), dict(top_p=0.6),
         dict(top_p=0.9, min_p=0.05), dict(min_p=0.2), dict(top_k=300, top_p=0.97), dict(top_k=1000)]


@pytest.mark.parametrize("case", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_kept_set_is_the_sorted_definitions(case, temperature):
    """Exactly the tokens the sorted definitions keep, through whichever path the row takes (the
    candidates for a small top_k, the whole-vocabulary search otherwise), and the former full-sort
    sampler's."""
    top_k, top_p, min_p = case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0)
    search = not 0 < top_k <= TOP_K_CANDIDATES
    for seed in range(3):
        logits = np.asarray(jax.random.normal(jax.random.key(seed), (BIG_VOCAB,))) * 4
        expected, _ = reference_keep(logits, temperature, top_k, top_p, min_p)
        scaled = jnp.asarray(logits) / temperature
        ours = _ours_keep(scaled, jnp.int32(top_k), jnp.float32(top_p), jnp.float32(min_p), search)
        np.testing.assert_array_equal(np.asarray(ours), expected)
        # The former sampler measured top-p's mass over the whole vocabulary even after top-k; vLLM
        # and transformers (and now we) renormalize over what top-k kept first. Alone, each agrees.
        if not min_p and not (top_k and top_p < 1.0):
            np.testing.assert_array_equal(np.asarray(_full_sort_keep(scaled, top_k, top_p)), expected)


def test_kept_set_matches_transformers_warpers():
    """transformers' TopK, TopP and MinP processors (each alone) mask what ours drop."""
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = np.asarray(jax.random.normal(jax.random.key(7), (BIG_VOCAB,))) * 3
    scaled = jnp.asarray(logits)
    for warper, (top_k, top_p, min_p) in [(TopKLogitsWarper(37), (37, 1.0, 0.0)),
                                          (TopPLogitsWarper(0.83), (0, 0.83, 0.0)),
                                          (MinPLogitsWarper(0.07), (0, 1.0, 0.07))]:
        theirs = warper(None, torch.tensor(logits[None])).numpy()[0] > -np.inf
        search = not 0 < top_k <= TOP_K_CANDIDATES
        ours = _ours_keep(scaled, jnp.int32(top_k), jnp.float32(top_p), jnp.float32(min_p), search)
        np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=type(warper).__name__)


@pytest.mark.parametrize("case, mode", [(dict(temperature=1.3, top_k=6, top_p=0.9), SampleMode.SAMPLE),
                                        (dict(temperature=0.9, top_p=0.85, min_p=0.02), SampleMode.SEARCH),
                                        (dict(temperature=1.2, top_k=20, top_p=0.9), SampleMode.SEARCH_TOP_K),
                                        (dict(temperature=1.0), SampleMode.SAMPLE)])
def test_draws_follow_the_kept_distribution(logits, case, mode):
    """Chi-square of 3000 seeded draws against the exact renormalized probabilities (fixed seed, so
    deterministic); nothing outside the kept set is ever drawn."""
    n = 3000
    draws = _draws(logits, n, mode, **case)
    keep, q = reference_keep(np.asarray(logits[0]), case["temperature"], case.get("top_k", 0),
                             case.get("top_p", 1.0), case.get("min_p", 0.0))
    counts = np.bincount(draws, minlength=VOCAB)
    assert not counts[~keep].any()
    likely = q * n > 5
    expected = q[likely] * n
    chi2 = (((counts[likely] - expected) ** 2) / expected).sum()
    assert chi2 < 3 * likely.sum(), (chi2, likely.sum())


def test_same_seed_same_tokens_whatever_shares_the_batch():
    """A row's draw depends on its own logits, parameters, seed and step only: not on its neighbours,
    its place in the batch, or which program (SAMPLE, SEARCH, SEARCH_TOP_K) the batch needed."""
    logits = jax.random.normal(jax.random.key(2), (4, BIG_VOCAB)) * 3
    params = SamplingArrays(jnp.array([0.8, 1.0, 0.0, 1.2]), jnp.array([50, 0, 0, 0], jnp.int32),
                            jnp.array([0.95, 1.0, 1.0, 0.7]), jnp.array([0.0, 0.05, 0.0, 0.0]),
                            jnp.array([7, 8, 1, 3], jnp.uint32), jnp.array([5, 2, 0, 9], jnp.int32))
    together = np.asarray(_sample(logits, params, SampleMode.SEARCH, 0, None, True).token_ids)
    flip = lambda tree: jax.tree_util.tree_map(lambda a: a[::-1], tree)  # noqa: E731
    reversed_ = np.asarray(_sample(logits[::-1], flip(params), SampleMode.SEARCH, 0, None, True).token_ids)
    np.testing.assert_array_equal(reversed_[::-1], together)
    # Rows 0-2 need no search: alone in the SAMPLE program (padded to the same S) they draw the same.
    row = lambda tree, i: jax.tree_util.tree_map(lambda a: a[i:i + 1].repeat(4, 0), tree)  # noqa: E731
    alone = [int(_sample(row(logits, i), row(params, i), SampleMode.SAMPLE, 0, None, True).token_ids[0])
             for i in range(3)]
    assert alone == together[:3].tolist()
    looped = np.asarray(_sample(logits, params, SampleMode.SEARCH, 0, None, False).token_ids)
    np.testing.assert_array_equal(looped, together)  # the search as a loop or unrolled: one answer
    with_top_k = np.asarray(_sample(logits, params, SampleMode.SEARCH_TOP_K, 0, None, True).token_ids)
    np.testing.assert_array_equal(with_top_k, together)  # a top-k search too changes no row without one


def test_different_steps_give_different_draws(logits):
    draws = _draws(logits, 200, SampleMode.SAMPLE, temperature=5.0)
    assert len(set(draws.tolist())) > 5


def test_pack_round_trips_through_one_int_array(logits):
    out = sample(jnp.repeat(logits, 2, axis=0), _arrays(2, temperature=0.0), SampleMode.GREEDY, 4)
    packed = np.asarray(pack(out))
    assert packed.dtype == np.int32 and packed.shape == (2, 2 + 2 * 4)
    np.testing.assert_array_equal(packed[:, 0], out.token_ids)
    np.testing.assert_array_equal(packed[:, 1].view(np.float32), out.logprobs)
    np.testing.assert_array_equal(packed[:, 6:].view(np.float32), out.top_logprobs)
