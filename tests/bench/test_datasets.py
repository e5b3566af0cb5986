"""Dataset statistics and seeding (the paper's traces, TCB's workload); padding arithmetic (host only, no jax)."""

import numpy as np
import pytest

from orca_jax.bench import plan as padding
from orca_jax.bench.datasets import DatasetName as TraceKind
from orca_jax.bench.datasets import LengthSpec, arrival_times, identical_trace, make_trace, tcb_service_rate, tcb_trace


def test_uniform_lengths_match_the_paper():
    trace = make_trace(TraceKind.UNIFORM, 20_000, rate=None, seed=0)
    prompts = np.array([r.prompt_len for r in trace.requests])
    gens = np.array([r.max_tokens for r in trace.requests])
    assert prompts.min() >= 32 and prompts.max() <= 512
    assert gens.min() >= 1 and gens.max() <= 128
    assert {prompts.min(), prompts.max(), gens.min(), gens.max()} == {32, 512, 1, 128}  # inclusive ends
    assert abs(prompts.mean() - 272) < 4 and abs(gens.mean() - 64.5) < 1.5
    assert np.all(np.array([r.arrival for r in trace.requests]) == 0.0)  # offline: all at time 0


def test_poisson_arrivals_have_the_requested_rate():
    trace = make_trace("uniform", 20_000, rate=25.0, seed=3)
    arrivals = np.array([r.arrival for r in trace.requests])
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 25.0) < 0.002
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: coefficient of variation 1


def test_seeding_is_deterministic_and_rates_share_requests():
    a = make_trace("uniform", 50, rate=10.0, seed=7)
    b = make_trace("uniform", 50, rate=10.0, seed=7)
    c = make_trace("uniform", 50, rate=10.0, seed=8)
    faster = make_trace("uniform", 50, rate=40.0, seed=7)
    assert a.requests == b.requests
    assert a.requests != c.requests
    # Same seed at another rate: the same requests, arrivals scaled by the rate ratio.
    assert [(r.prompt_len, r.max_tokens) for r in a.requests] == [(r.prompt_len, r.max_tokens) for r in faster.requests]
    np.testing.assert_allclose([4 * r.arrival for r in faster.requests], [r.arrival for r in a.requests])
    assert a.prompt_ids(3, 1000) == b.prompt_ids(3, 1000) != c.prompt_ids(3, 1000)
    ids = a.prompt_ids(5, 300)
    assert len(ids) == a.requests[5].prompt_len and min(ids) >= 3 and max(ids) < 300
    assert a.describe()["seed"] == 7 and a.describe()["rate"] == 10.0


def test_homogeneous_and_sharegpt_traces():
    same = identical_trace(16, 128, 32)
    assert all((r.prompt_len, r.max_tokens, r.arrival) == (128, 32, 0.0) for r in same.requests)
    spec = LengthSpec()
    share = make_trace(TraceKind.SHAREGPT_LIKE, 5_000, rate=None, seed=1)
    prompts = np.array([r.prompt_len for r in share.requests])
    gens = np.array([r.max_tokens for r in share.requests])
    assert spec.sharegpt_prompt_clip[0] <= prompts.min() and prompts.max() <= spec.sharegpt_prompt_clip[1]
    assert spec.sharegpt_gen_clip[0] <= gens.min() and gens.max() <= spec.sharegpt_gen_clip[1]
    assert abs(np.median(prompts) - spec.sharegpt_prompt[0]) < 15  # lognormal median survives the clip
    assert prompts.mean() > np.median(prompts)  # right-skewed


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        make_trace("uniform", 0)
    with pytest.raises(ValueError):
        make_trace("uniform", 5, rate=-1.0)
    assert make_trace("uniform", 5, rate=float("inf")).rate is None


def test_padding_arithmetic_by_hand():
    lengths = [(2, 3), (4, 1), (3, 3)]
    real = (2 + 3 - 1) + (4 + 1 - 1) + (3 + 3 - 1)  # 13 tokens fed
    # Batches of 2: {(2,3),(4,1)} pads to prompt 4, gen 3 -> 2 x 6; {(3,3)} alone -> 5.
    assert padding.request_level_fed(lengths, 2) == 12 + 5
    assert padding.request_level_fed(lengths, 1) == real
    real_ragged, padded, iterations = padding.ragged_fed(lengths, batch_size=4, max_num_batched_tokens=64, page_size=4)
    assert real_ragged == real and padded >= real and iterations == 3  # one prefill + two increments


def test_burstiness_one_is_poisson_and_infinite_is_even():
    np.testing.assert_allclose(arrival_times(50, 4.0, 7), [r.arrival for r in make_trace("uniform", 50, 4.0, seed=7).requests])
    np.testing.assert_allclose(arrival_times(4, 2.0, 0, burstiness=float("inf")), [0.0, 0.5, 1.0, 1.5])
    gaps = np.diff(arrival_times(20_000, 10.0, 1, burstiness=4.0))
    assert abs(gaps.mean() - 0.1) < 0.003 and abs(gaps.std() / gaps.mean() - 0.5) < 0.03  # Gamma(4): cv 1/2
    assert not arrival_times(3, None, 0).any()


def test_tcb_workload():
    trace = tcb_trace(4000, variance=100.0, load=2.0, max_num_seqs=4, seed=1)
    lengths = np.array([r.prompt_len + r.max_tokens for r in trace.requests])
    assert lengths.min() >= 3 and lengths.max() <= 100 and 17 < lengths.mean() < 23
    assert all(r.prompt_len == max(1, (r.prompt_len + r.max_tokens) // 4) and r.max_tokens >= 1 for r in trace.requests)
    assert trace.time_unit == "iteration" and 0.2 < tcb_service_rate(4, 20.0) < 0.4  # 4 slots / ~15 generated tokens
    arrivals = np.array([r.arrival for r in trace.requests])
    assert abs(len(trace) / arrivals[-1] - 2.0 * tcb_service_rate(4, 100.0)) < 0.05  # Poisson at the load's rate
    budgets = np.array([r.deadline for r in trace.requests])
    assert np.all((budgets >= lengths) & (budgets <= 3 * lengths))  # proportional: slack U(1, 3) x l
    uniform = tcb_trace(500, 20.0, 1.0, 4, deadlines="uniform")
    assert all(20.0 <= r.deadline <= 80.0 for r in uniform.requests)


def test_lengths_fit_a_context_prompts_first_and_say_which_flags():
    spec, notes = LengthSpec().fit(512)
    assert (spec.prompt_range, spec.gen_range) == ((32, 384), (1, 128))  # the outputs kept, the prompts shortened
    assert spec.homogeneous == (128, 32) and spec.sharegpt_prompt_clip == (4, 256)
    assert set(notes) == {TraceKind.UNIFORM, TraceKind.SHAREGPT_LIKE}
    assert "--uniform-input-range 32:512" in notes[TraceKind.UNIFORM]
    assert LengthSpec().fit(100_000) == (LengthSpec(), {})
    for context in (2, 40, 128, 512, 1000):  # every request of every dataset fits
        fitted, _ = LengthSpec().fit(context)
        for kind in (TraceKind.UNIFORM, TraceKind.HOMOGENEOUS, TraceKind.SHAREGPT_LIKE):
            trace = make_trace(kind, 200, None, 0, fitted)
            assert max(r.prompt_len + r.max_tokens for r in trace.requests) <= context, (context, kind)
    short = LengthSpec().fit(128)[0]  # past half the context the outputs give way too
    assert (short.prompt_range, short.gen_range, short.homogeneous) == ((32, 64), (1, 64), (96, 32))
