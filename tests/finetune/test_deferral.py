"""Deferred Continuous Batching: the policy's rule, and on a tiny model a steady inference stream while a
job runs: no request waits past the deferral bound, the job still progresses in the gaps, and every
request's tokens are those of a run without the job; with a slowdown above 1 the job also runs beside
running requests, within its share, and with a TPOT SLO within every decoding request's slack."""

from __future__ import annotations

import time

import pytest

from orca_jax.core.request import Request, RequestStatus
from orca_jax.engine import Engine
from orca_jax.finetune.deferral import DeferralPolicy, tpot_slack
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.models.loader import load_model
from orca_jax.sample.mode import SampleMode
from orca_jax.sample.sampler import SampleKey
from orca_jax.sampling_params import SamplingParams

from tests.helpers.finetune import RECORDS, drive, engine_config, upload
from tests.helpers.hf_dirs import write_hf_dir

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
    # New limits start afresh: a debt run up under a TPOT SLO is not the new slowdown's.
    policy.set_limits(tpot_slo_s=0.02)
    policy.record(5.0, tokens=10, deferred=False, beside=True)
    policy.set_limits(max_inference_slowdown=1.5)
    assert not policy.may_run_beside(now=2000.0)  # the credit starts accruing
    assert policy.may_run_beside(now=2000.03)


def decoding(first_token_time: float, num_tokens: int) -> Request:
    request = Request("r", [1, 2], SamplingParams(max_tokens=100), status=RequestStatus.RUNNING)
    request.first_token_time, request.output_token_ids = first_token_time, [7] * num_tokens
    return request


def test_tpot_slack_is_the_least_decoding_requests():
    waiting = Request("w", [1], SamplingParams(), arrival_time=0.0)  # no first token: not counted
    assert tpot_slack([waiting], slo_s=0.02, now=1.0) is None
    # 11 tokens in 0.15 s: 10 gaps may take 0.2 s, so 0.05 s to spare; the newest (1 token) has none.
    assert tpot_slack([decoding(0.85, 11), waiting], slo_s=0.02, now=1.0) == pytest.approx(0.05)
    assert tpot_slack([decoding(0.85, 11), decoding(0.99, 1)], slo_s=0.02, now=1.0) == pytest.approx(-0.01)


def test_a_tpot_slo_holds_every_requests_tpot_and_backs_off_with_load():
    """Simulated clock: inference iterations give every running request a token; a fine-tuning iteration
    (30 ms) runs between two of them whenever the policy allows. Under the SLO every request's TPOT
    stays within it, and as the iterations get slower (a heavier load) the job takes less."""
    with pytest.raises(ValueError):
        DeferralPolicy(bound_s=1.0, tpot_slo_s=0.0)

    def simulate(iteration_s: float) -> tuple[float, list[float]]:
        policy = DeferralPolicy(bound_s=1.0, tpot_slo_s=0.02)
        assert policy.runs_beside
        running: list[Request] = []
        tpots, now, fine_tuning, arrivals = [], 0.0, 0.0, 0
        while now < 20.0:
            if now >= arrivals * 0.05:  # a request every 50 ms, 40 tokens each
                running.append(Request(f"r{arrivals}", [1], SamplingParams(max_tokens=40),
                                       status=RequestStatus.RUNNING))
                arrivals += 1
            if policy.may_run_beside(now, lambda: running):
                policy.record(0.03, tokens=10, deferred=False, beside=True)
                now, fine_tuning = now + 0.03, fine_tuning + 0.03
            now += iteration_s
            for request in running:
                request.output_token_ids.append(7)
                if request.first_token_time is None:
                    request.first_token_time = now
            for request in [r for r in running if len(r.output_token_ids) == 40]:
                tpots.append((now - request.first_token_time) / 39)
                running.remove(request)
        return fine_tuning / now, tpots

    light_share, light_tpots = simulate(iteration_s=0.006)
    heavy_share, heavy_tpots = simulate(iteration_s=0.015)
    assert max(light_tpots + heavy_tpots) <= 0.02 + 1e-9
    assert light_share > 0.25 and heavy_share < light_share / 2, (light_share, heavy_share)
    # Never while no request has its first token (a prefill's TTFT is the deferral bound's business).
    assert not DeferralPolicy(bound_s=1.0, tpot_slo_s=0.02).may_run_beside(1.0, tuple)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return load_model(directory)


PROMPTS = [[5 + i, 17, 42 + i, 9, 33] for i in range(12)]
SAMPLING = SamplingParams(max_tokens=6, temperature=0)


def run_stream(engine: Engine, interval_s: float) -> dict[str, tuple[list[int], float, float]]:
    """PROMPTS arriving every interval_s; each one's (tokens, seconds waited for admission, TPOT)."""
    results: dict[str, tuple[list[int], float, float]] = {}
    first: dict[str, float] = {}
    start = time.monotonic()
    added = 0
    while len(results) < len(PROMPTS):
        assert time.monotonic() < start + 60, f"{len(results)} of {len(PROMPTS)} requests finished"
        if added < len(PROMPTS) and time.monotonic() >= start + added * interval_s:
            engine.add_request(PROMPTS[added], SAMPLING, request_id=f"r{added}")
            added += 1
        if engine.has_work():
            for out in engine.step():
                first.setdefault(out.request_id, time.monotonic())
                if out.finished:
                    tpot = (time.monotonic() - first[out.request_id]) / (len(out.output_token_ids) - 1)
                    results[out.request_id] = (out.output_token_ids, out.queue_seconds, tpot)
        else:
            time.sleep(0.001)
    return results


@pytest.mark.slow  # ~25 s: a job's compile and a stream of a few seconds, twice
def test_bound_holds_under_a_steady_stream(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path), deferral_bound_s=BOUND_S, max_epochs=100_000), loaded)
    # No request may wait for a compile (the waits must be the deferral's): the stream's programs first.
    engine.runner.precompile([key for key in engine.program_keys() if not getattr(key, "lora", False)
                              and not (isinstance(key, SampleKey) and (key.num_top_logprobs or key.mode != SampleMode.GREEDY))])
    alone = run_stream(engine, interval_s=0.25)
    tuner = engine.fine_tuning
    file_id = upload(tuner, RECORDS * 8)
    # Many steps of several micro-batches each: the job outlasts the stream.
    hp = TrainingHyperparameters(n_epochs=100_000, batch_size=32, micro_batch_tokens=64, checkpoint_every=10**6)
    job_id = tuner.create_job(file_id, hp, rank=8)["id"]
    drive(engine, lambda: engine.stats().fine_tuning_iterations >= 3)  # compiled, one iteration measured
    iteration_s = tuner.policy.iteration_estimate
    assert iteration_s < BOUND_S / 3, iteration_s
    step_before = tuner.job(job_id)["step"]
    iterations_before = engine.stats().fine_tuning_iterations

    shared = run_stream(engine, interval_s=0.25)
    waits = sorted(wait for _, wait, _ in shared.values())
    assert waits[-1] <= BOUND_S + SLACK_S, waits
    stats = engine.stats()
    assert stats.inference_deferrals_total > 0  # requests did wait for fine-tuning...
    assert waits[-1] > iteration_s  # ... longer than one iteration: held back, then let in
    assert stats.fine_tuning_iterations - iterations_before >= 2 * len(PROMPTS)  # the job went on in the gaps
    assert tuner.job(job_id)["step"] >= step_before
    assert {rid: tokens for rid, (tokens, *_) in shared.items()} == {rid: tokens for rid, (tokens, *_) in alone.items()}
    assert tuner.policy.stats.beside == 0  # max_inference_slowdown 1: never while requests run

    # Beside running requests, within a slowdown of 2: iterations run while requests do, at most about
    # half the stream's time, and the requests' tokens stay theirs.
    tuner.policy.set_limits(max_inference_slowdown=2.0)
    start = time.monotonic()
    beside = run_stream(engine, interval_s=0.25)
    wall = time.monotonic() - start
    counters = tuner.policy.stats
    assert counters.beside > 0
    assert counters.beside_seconds <= 0.5 * wall + iteration_s + SLACK_S, (counters.beside_seconds, wall)
    assert {rid: tokens for rid, (tokens, *_) in beside.items()} == {rid: tokens for rid, (tokens, *_) in alone.items()}

    # Beside running requests within a TPOT SLO: iterations run while requests decode, and no request's
    # TPOT passes the SLO by more than what one iteration running past its estimate can add.
    slo = 2 * iteration_s + max(tpot for *_, tpot in alone.values())
    tuner.policy.set_limits(tpot_slo_s=slo)
    before = tuner.policy.stats.beside
    within = run_stream(engine, interval_s=0.25)
    assert tuner.policy.stats.beside > before
    assert max(tpot for *_, tpot in within.values()) <= slo + SLACK_S / (SAMPLING.max_tokens - 1), (slo, within)
    assert {rid: tokens for rid, (tokens, *_) in within.items()} == {rid: tokens for rid, (tokens, *_) in alone.items()}
    # A SLO no decoding request meets even alone: never beside them.
    tuner.policy.set_limits(tpot_slo_s=1e-4)
    before = tuner.policy.stats.beside
    run_stream(engine, interval_s=0.25)
    assert tuner.policy.stats.beside == before
    tuner.cancel(job_id)
