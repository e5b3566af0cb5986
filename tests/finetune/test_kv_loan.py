"""The KV pool lends its top pages to a running fine-tuning job (finetune/kv_loan.py): on a tiny model the pool's
arrays shrink while the job runs, a burst the smaller pool cannot admit makes the job park and the
pages come back, the burst's tokens are those of a run without the job, and the job then borrows the
pages again and ends with the adapter of a run never interrupted."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from orca_jax.config import FineTuningMemory
from orca_jax.core.request import Request, RequestStatus
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.finetune.offline import run_fine_tune
from orca_jax.models.loader import load_model
from orca_jax.sampling_params import SamplingParams

from tests.helpers.finetune import RECORDS, drive, engine_config, upload
from tests.helpers.hf_dirs import write_hf_dir

# Examples of 54-78 tokens in rows of 128, one row per micro-batch: three micro-batches per step, so a
# park can fall inside a step, with its accumulated gradient.
LONG = [{"prompt": r["prompt"] * 12, "completion": r["completion"]} for r in RECORDS]
HP = TrainingHyperparameters(n_epochs=30, batch_size=4, learning_rate_multiplier=10, micro_batch_tokens=16,
                             checkpoint_every=1000)
# The deferral bound: a refused request waits half of it before the job parks. Short, because while the
# burst waits the job runs ahead (Deferred Continuous Batching): with warm programs a long bound let it
# finish all its steps before the burst was admitted, and nothing was left to park.
BOUND_S = 0.02
BURST = 6  # requests of 16 pages each: the lent pool (64 - 31 pages) admits two


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return load_model(directory)


def burst(engine: Engine) -> list[list[int]]:
    """BURST requests of 57 + 64 tokens at once, run to the end; their tokens in order."""
    ids = [engine.add_request([3 + i] + list(range(10, 66)), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
           for i in range(BURST)]
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] = output.output_token_ids
    return [list(tokens[rid]) for rid in ids]


def adapter_arrays(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_a_job_borrows_the_pages_and_gives_them_back_to_a_burst(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path / "jobs"), deferral_bound_s=BOUND_S), loaded)
    runner, full = engine.runner, engine.runner.full_pages
    lent = runner.lendable_pages
    assert lent == full - 1 - engine.kv.num_pages_for(engine.max_model_len)  # keeps one longest request
    alone = burst(engine)
    assert not engine.kv.lent and engine.kv_loan.stats.loans == 0  # no job, nothing lent

    tuner = engine.fine_tuning
    job_id = tuner.create_job(upload(tuner, LONG), HP, rank=4)["id"]
    drive(engine, lambda: engine.stats().fine_tuning_iterations >= 2)
    assert engine.kv.lent and engine.stats().kv_pages_lent == lent
    assert {layer.k.shape[1] for stage in runner.stages for layer in stage.kv} == {full - lent}  # memory freed
    assert engine.kv.num_usable_pages == full - lent - 1

    shared = burst(engine)
    assert shared == alone
    stats = engine.stats()
    assert tuner.job(job_id)["status"] == "running"
    assert stats.fine_tuning_parks_total >= 1 and stats.kv_pages_lent == 0

    # Under a TPOT SLO a parked job does not resume beside running requests, however much slack they
    # have (a resume's copies are no iteration's length): only in an idle turn.
    tuner.policy.set_limits(tpot_slo_s=10.0)
    decoding = Request("d", [1, 2], SamplingParams(max_tokens=100), status=RequestStatus.RUNNING)
    decoding.first_token_time, decoding.output_token_ids = time.monotonic() - 1.0, [7] * 50
    assert not tuner.maybe_run_beside(time.monotonic(), lambda: [decoding])
    assert not engine.kv.lent
    tuner.policy.set_limits()

    drive(engine, lambda: tuner.job(job_id)["status"] in ("succeeded", "failed"))
    job = tuner.job(job_id)
    assert job["status"] == "succeeded", job["error"]
    assert engine.stats().kv_loans_total >= 2  # borrowed again after the burst
    assert not engine.kv.lent and {layer.k.shape[1] for layer in runner.stages[0].kv} == {full}  # back at the end
    events = [e["message"] for e in tuner.store.events(job_id)]
    assert any(m.startswith("Paused at step") for m in events) and any(m.startswith("Resumed at step") for m in events)

    # Parked and resumed, possibly inside a step: the same adapter as a job never interrupted.
    whole = Engine(engine_config(str(tmp_path / "whole")), loaded)
    expected = run_fine_tune(whole, LONG, hyperparameters=HP, lora_request=None, rank=4, alpha=None,
                             target_modules=None, suffix=None, use_tqdm=False)
    ours = adapter_arrays(tuner.served()[job["fine_tuned_model"]].lora_path)
    theirs = adapter_arrays(expected.lora_path)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert burst(engine) == alone  # the pool grown back serves as before


def test_reserve_lends_nothing(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path), memory_policy=FineTuningMemory.RESERVE), loaded)
    assert engine.kv_loan is None and engine.runner.lendable_pages == 0
    assert engine.kv.loan_start == engine.kv.num_pages
