"""Deferred Continuous Batching: the policy's rule, and on a tiny model a steady inference stream while a
job runs: no request waits past the deferral bound, the job still progresses in the gaps, and every
request's tokens are those of a run without the job; with a slowdown above 1 the job also runs beside
running requests, within its share."""

from __future__ import annotations

import time

import pytest

from finetune_helpers import RECORDS, drive, engine_config, upload
from hf_dirs import write_hf_dir
from orca_jax.compilation import SampleKey
from orca_jax.logits_rules import SampleMode
from orca_jax.engine import Engine
from orca_jax.finetune.deferral import DeferralPolicy
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.models.loader import load_model
from orca_jax.request import SamplingParams

BOUND_S = 0.3
# Slack over the bound for the host loop's own granularity and an iteration running a little longer
# than the longest recent one (CPU timing on a shared machine).
SLACK_S = 0.1


def test_policy_rule():
    policy = DeferralPolicy(bound_s=1.0)
    assert policy.may_run(None, now=5.0)  # nobody waits
    assert not policy.may_run(4.9, now=5.0)  # somebody waits and one iteration's length is unknown
    policy.record(0.5, tokens=10, deferred=False)
    policy.record(0.25, tokens=10, deferred=True)
    assert policy.iteration_estimate == 0.5  # the longest recent
    assert policy.may_run(4.5, now=5.0)  # waited 0.5 + 0.5 = the bound
    assert not policy.may_run(4.25, now=5.0)  # 0.75 + 0.5 would pass it
    stats = policy.stats
    assert (stats.iterations, stats.tokens, stats.deferrals) == (2, 20, 1)
    assert stats.deferral_seconds == 0.25
    with pytest.raises(ValueError):
        DeferralPolicy(bound_s=0)


def test_beside_running_requests_fine_tuning_keeps_its_share():
    """With max_inference_slowdown k, iterations beside running requests take 1 - 1/k of the time."""
    assert not DeferralPolicy(bound_s=1.0).may_run_beside(now=1.0)  # k = 1: never while requests run
    with pytest.raises(ValueError):
        DeferralPolicy(bound_s=1.0, max_inference_slowdown=0.9)
    policy = DeferralPolicy(bound_s=1.0, max_inference_slowdown=1.5)
    assert not policy.may_run_beside(now=0.0)  # the credit starts accruing
    assert policy.may_run_beside(now=0.03)  # 1/3 of 30 ms, capped at 10 ms before an iteration is measured
    policy.record(0.3, tokens=10, deferred=False, beside=True)
    assert not policy.may_run_beside(now=0.83)  # 0.01 - 0.3 + 0.5 / 3 < 0: inference's turn
    # A steady stream: inference iterations of 10 ms, fine-tuning iterations of 30 ms when the credit allows.
    now, fine_tuning = 0.83, 0.0
    while now < 60.0:
        if policy.may_run_beside(now):
            policy.record(0.03, tokens=10, deferred=False, beside=True)
            now, fine_tuning = now + 0.03, fine_tuning + 0.03
        now += 0.01
    assert fine_tuning / (now - 0.83) == pytest.approx(1 / 3, abs=0.02)
    assert policy.stats.beside_seconds == pytest.approx(0.3 + fine_tuning)
    policy.idle()  # no request runs: the idle spell buys nothing
    credit = policy._credit
    policy.may_run_beside(now=1000.0)
    assert policy._credit == credit


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return load_model(directory)


PROMPTS = [[5 + i, 17, 42 + i, 9, 33] for i in range(12)]
SAMPLING = SamplingParams(max_tokens=6, temperature=0)


def run_stream(engine: Engine, interval_s: float) -> dict[str, tuple[list[int], float]]:
    """PROMPTS arriving every interval_s; each one's (tokens, seconds waited for admission)."""
    results: dict[str, tuple[list[int], float]] = {}
    start = time.monotonic()
    added = 0
    while len(results) < len(PROMPTS):
        assert time.monotonic() < start + 60, f"{len(results)} of {len(PROMPTS)} requests finished"
        if added < len(PROMPTS) and time.monotonic() >= start + added * interval_s:
            engine.add_request(PROMPTS[added], SAMPLING, request_id=f"r{added}")
            added += 1
        if engine.has_work():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = (out.output_token_ids, out.queue_seconds)
        else:
            time.sleep(0.001)
    return results


@pytest.mark.slow  # ~25 s: a job's compile and a stream of a few seconds, twice
def test_bound_holds_under_a_steady_stream(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path), deferral_bound_s=BOUND_S), loaded)
    # No request may wait for a compile (the waits must be the deferral's): the stream's programs first.
    engine.runner.precompile([key for key in engine.program_keys() if not getattr(key, "lora", False)
                              and not (isinstance(key, SampleKey) and (key.num_top_logprobs or key.mode != SampleMode.GREEDY))])
    alone = run_stream(engine, interval_s=0.25)
    tuner = engine.fine_tuning
    file_id = upload(tuner, RECORDS * 8)
    # Many steps of several micro-batches each: the job outlasts the stream.
    hp = TrainingHyperparameters(n_epochs=1000, batch_size=32, micro_batch_tokens=64, checkpoint_every=1000)
    job_id = tuner.create_job(file_id, hp, rank=8)["id"]
    drive(engine, lambda: engine.stats().fine_tuning_iterations >= 3)  # compiled, one iteration measured
    iteration_s = tuner.policy.iteration_estimate
    assert iteration_s < BOUND_S / 3, iteration_s
    step_before = tuner.job(job_id)["step"]
    iterations_before = engine.stats().fine_tuning_iterations

    shared = run_stream(engine, interval_s=0.25)
    waits = sorted(wait for _, wait in shared.values())
    assert waits[-1] <= BOUND_S + SLACK_S, waits
    stats = engine.stats()
    assert stats.inference_deferrals_total > 0  # requests did wait for fine-tuning...
    assert waits[-1] > iteration_s  # ... longer than one iteration: held back, then let in
    assert stats.fine_tuning_iterations - iterations_before >= 2 * len(PROMPTS)  # the job went on in the gaps
    assert tuner.job(job_id)["step"] >= step_before
    assert {rid: tokens for rid, (tokens, _) in shared.items()} == {rid: tokens for rid, (tokens, _) in alone.items()}
    assert tuner.policy.stats.beside == 0  # max_inference_slowdown 1: never while requests run

    # Beside running requests, within a slowdown of 2: iterations run while requests do, at most about
    # half the stream's time, and the requests' tokens stay theirs.
    tuner.policy.max_inference_slowdown = 2.0
    start = time.monotonic()
    beside = run_stream(engine, interval_s=0.25)
    wall = time.monotonic() - start
    counters = tuner.policy.stats
    assert counters.beside > 0
    assert counters.beside_seconds <= 0.5 * wall + iteration_s + SLACK_S, (counters.beside_seconds, wall)
    assert {rid: tokens for rid, (tokens, _) in beside.items()} == {rid: tokens for rid, (tokens, _) in alone.items()}
    tuner.cancel(job_id)
