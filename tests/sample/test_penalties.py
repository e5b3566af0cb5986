"""On-device logits processing against a numpy reference of vLLM's formulas and transformers' processors:
the allowed-token bitmask, the logit table (conditional entries included), the penalties from the count
tables, and how those tables are filled and counted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.sample.ops.penalties import (LogitsArrays, PenaltyTables, count_sampled, fill_tables, process_logits,
                                           unpack_mask)
from orca_jax.sample.rules import pack_token_mask

S, V, W, SLOTS = 6, 300, 5, 4


def reference(logits, allowed, entries, counts, prompt, presence, frequency, repetition):
    """vLLM's order and formulas (vllm/v1/sample/sampler.py, ops/penalties.py) in float64: allowed
    tokens, then the bans and biases, then repetition (tokens in the prompt or the output: positive
    logits divided, negative multiplied), frequency (times the count) and presence (once)."""
    x = np.where(allowed, logits.astype(np.float64), -np.inf)
    for token, value in entries:
        x[token] += value
    seen = prompt | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(SLOTS, V)) * (rng.random((SLOTS, V)) < 0.1)
    prompt = rng.random((SLOTS, V)) < 0.05
    tables = PenaltyTables(jnp.asarray(counts, jnp.int32), jnp.asarray(prompt))
    last_samples = np.array([11, 12, 13, 14, 15, 16, 17, 18], np.int32)  # the previous batch's samples
    rows = [  # (slot, presence, frequency, repetition, sampled_source, entries as (token, value, condition), allowed)
        (0, 0.5, 0.3, 1.3, -1, [(5, 2.0, -1), (6, -np.inf, -1)], None),
        (-1, 0.0, 0.0, 1.0, 2, [(7, -np.inf, 13), (8, -np.inf, 99)], None),  # 13 matches, 99 does not
        (2, -0.4, 0.0, 0.7, 0, [], [1, 2, 3, 250, 299]),
        (3, 0.0, 1.5, 1.0, -1, [(9, 1.5, -1), (9, 1.5, -1)], None),  # the same token twice: both add
        (-1, 0.0, 0.0, 1.0, -1, [], None),  # nothing: unchanged
        (1, 2.0, -2.0, 2.0, 5, [(V - 1, -np.inf, 16)], list(range(0, V, 2)))]
    arrays = dict(presence=[], frequency=[], repetition=[], slot=[], source=[], ids=[], values=[], conds=[], mask=[])
    expected = []
    for i, (slot, presence, frequency, repetition, source, entries, allowed) in enumerate(rows):
        for name, value in zip(("slot", "presence", "frequency", "repetition", "source"),
                               (slot, presence, frequency, repetition, source)):
            arrays[name].append(value)
        ids, values, conds = (list(col) for col in zip(*entries)) if entries else ([], [], [])
        arrays["ids"].append(ids + [V] * (W - len(ids)))  # V: no entry
        arrays["values"].append(values + [0.0] * (W - len(ids)))
        arrays["conds"].append(conds + [-1] * (W - len(ids)))
        arrays["mask"].append(pack_token_mask(allowed if allowed is not None else range(V), V))
        previous = last_samples[source] if source >= 0 else -1
        applied = [(t, v) for t, v, c in entries if c < 0 or c == previous]
        row_counts = counts[slot] if slot >= 0 else np.zeros(V, int)
        row_prompt = prompt[slot] if slot >= 0 else np.zeros(V, bool)
        allowed_mask = np.isin(np.arange(V), allowed) if allowed is not None else np.ones(V, bool)
        expected.append(reference(logits[i], allowed_mask, applied, row_counts, row_prompt, presence, frequency,
                                  repetition))
    la = LogitsArrays(jnp.asarray(arrays["presence"], jnp.float32), jnp.asarray(arrays["frequency"], jnp.float32),
                      jnp.asarray(arrays["repetition"], jnp.float32), jnp.asarray(arrays["slot"], jnp.int32),
                      jnp.asarray(arrays["source"], jnp.int32), jnp.asarray(arrays["ids"], jnp.int32),
                      jnp.asarray(arrays["values"], jnp.float32), jnp.asarray(arrays["conds"], jnp.int32),
                      jnp.asarray(np.stack(arrays["mask"])))
    return logits, la, tables, jnp.asarray(last_samples), np.stack(expected)


def test_processing_equals_the_reference_formulas(case):
    logits, arrays, tables, last_samples, expected = case
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), arrays, tables, last_samples))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    assert np.isneginf(got[1, 7]) and not np.isneginf(got[1, 8])  # the conditional ban met, the other not
    np.testing.assert_array_equal(got[4], logits[4])


def test_repetition_penalty_matches_transformers():
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + output equals ours with the prompt
    in the slot's prompt mask and the output in its counts."""
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, V)).astype(np.float32) * 4
    prompt_ids, output_ids = rng.integers(0, V, 40), rng.integers(0, V, 25)
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(np.concatenate([prompt_ids, output_ids])[None]),
                                                  torch.tensor(logits)).numpy()
    counts = np.bincount(output_ids, minlength=V)[None]
    prompt = np.isin(np.arange(V), prompt_ids)[None]
    arrays = LogitsArrays(jnp.zeros(1), jnp.zeros(1), jnp.full(1, 1.7), jnp.zeros(1, jnp.int32),
                          jnp.full(1, -1, jnp.int32), jnp.full((1, 1), V, jnp.int32), jnp.zeros((1, 1)),
                          jnp.full((1, 1), -1, jnp.int32), jnp.asarray(pack_token_mask(range(V), V)[None]))
    ours = process_logits(jnp.asarray(logits), arrays, PenaltyTables(jnp.asarray(counts, jnp.int32),
                                                                     jnp.asarray(prompt)), jnp.zeros(1, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)


def test_packed_mask_round_trips():
    allowed = [0, 31, 32, 33, 255, 256, 299]
    words = pack_token_mask(allowed, V)
    assert words.dtype == np.int32 and words.shape == (-(-V // 32),)
    assert np.flatnonzero(np.asarray(unpack_mask(jnp.asarray(words[None]), V))[0]).tolist() == allowed


def test_fill_resets_then_marks_the_prompt_and_counts_outputs():
    tables = PenaltyTables(jnp.ones((SLOTS, V), jnp.int32), jnp.ones((SLOTS, V), bool))
    resets = jnp.array([1, 3, -1], jnp.int32)
    entries = jnp.array([[1, 5, 0], [1, 6, 0], [1, 6, 2], [3, 7, 1], [-1, 9, 4], [1, 8, 3]], jnp.int32)
    counts, prompt = (np.asarray(a) for a in jax.jit(fill_tables)(tables, resets, entries))
    assert (counts[[0, 2]] == 1).all() and prompt[[0, 2]].all()  # untouched slots
    assert np.flatnonzero(prompt[1]).tolist() == [5, 6] and np.flatnonzero(prompt[3]).tolist() == []
    assert {int(t): int(counts[1, t]) for t in np.flatnonzero(counts[1])} == {6: 2, 8: 3}
    assert {int(t): int(counts[3, t]) for t in np.flatnonzero(counts[3])} == {7: 1}


def test_each_sampled_token_counts_in_its_slot_only():
    tables = PenaltyTables(jnp.zeros((SLOTS, V), jnp.int32), jnp.zeros((SLOTS, V), bool))
    tables = count_sampled(tables, jnp.array([2, -1, 0, 2], jnp.int32), jnp.array([7, 8, 9, 7], jnp.int32))
    counts = np.asarray(tables.output_counts)
    assert counts.sum() == 3 and counts[2, 7] == 2 and counts[0, 9] == 1
