"""The job's memory: held back from a pool sized from free memory, a job naming no micro_batch_tokens
sized to fit it, and a job that needs more than it is refused with the figures (checked by hand, and
on a tiny model)."""

from __future__ import annotations

import dataclasses

import pytest

from orca_jax.config import CacheConfig
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import DEFAULT_MICRO_BATCH_TOKENS, LoRASpec, resolve_targets
from orca_jax.finetune.sizing import MAX_REFINEMENTS, fit_rows
from orca_jax.finetune.trainer import LoRATrainer
from orca_jax.models.loader import load_model
from orca_jax.models.presets import PRESETS
from orca_jax.worker.kv_pool import GPU_KV_FRACTION, num_pages_for

from tests.helpers.finetune import FAST, RECORDS, drive, engine_config, upload
from tests.helpers.hf_dirs import write_hf_dir

GIB = 2**30


@dataclasses.dataclass
class FakeGPU:
    platform: str = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 80 * GIB, "bytes_in_use": 1 * GIB}


def test_the_reserve_comes_out_of_a_pool_sized_from_free_memory():
    tiny = PRESETS["tiny-llama"]
    page_bytes = tiny.kv_bytes_per_token * 16
    cache = CacheConfig(page_size=16)

    def pages(budget):
        pages = int(budget * GPU_KV_FRACTION // page_bytes)
        return pages - pages % 256

    assert num_pages_for(tiny, cache, 10 * GIB, FakeGPU()) == pages(69 * GIB)
    assert num_pages_for(tiny, cache, 10 * GIB, FakeGPU(), reserve_bytes=4 * GIB) == pages(65 * GIB)
    explicit = CacheConfig(page_size=16, num_pages=100)  # asked for: kept
    assert num_pages_for(tiny, explicit, 10 * GIB, FakeGPU(), reserve_bytes=4 * GIB) == 100


def test_a_job_that_cannot_fit_is_refused_with_the_figures(tmp_path):
    directory = str(tmp_path / "model")
    write_hf_dir(directory, "llama")
    engine = Engine(engine_config(str(tmp_path / "jobs"), memory_gib=1e-4), load_model(directory))
    tuner = engine.fine_tuning
    job_id = tuner.create_job(upload(tuner, RECORDS), FAST, rank=4)["id"]
    drive(engine, lambda: tuner.job(job_id)["status"] == "failed")
    error = tuner.job(job_id)["error"]
    assert error["code"] == "insufficient_memory"
    assert "GiB of device memory" in error["message"] and "0.00 GiB is lent by the KV pool for fine-tuning" in error["message"]
    assert not engine.has_work()


def test_activations_are_kept_when_they_fit_and_recomputed_when_not(tmp_path):
    directory = str(tmp_path / "model")
    write_hf_dir(directory, "llama")
    engine = Engine(engine_config(str(tmp_path / "jobs")), load_model(directory))
    stage = engine.runner.stages[0]
    spec = LoRASpec(4, 8.0, resolve_targets(None, engine.model_config.family))

    def compiled(budget):
        trainer = LoRATrainer(stage.model, stage.params, spec, FAST, (2, 64), 10, stage.replicated, None, budget)
        return trainer, trainer.start_compiling().result()

    roomy, kept = compiled(None)
    assert roomy.remat is False and kept.remat is False
    tight, recomputed = compiled(kept.total_bytes - 1)  # kept activations no longer fit: recompute them
    assert tight.remat is True and recomputed.remat is True
    assert recomputed.temp_bytes < kept.temp_bytes


def test_sizing_compiles_few_sizes_and_keeps_the_most_rows_that_fit():
    def sizes(memory, max_rows, budget):
        tried = []

        def measure(rows):
            tried.append(rows)
            return memory(rows)

        return fit_rows(measure, max_rows, budget), tried

    linear = lambda rows: 10 + 5 * rows  # noqa: E731
    assert sizes(linear, 16, 100) == (16, [16])  # the most fit: one compile
    assert sizes(linear, 16, 52) == (8, [16, 1, 8])  # the line through 1 and 16 rows says 8: three
    assert sizes(linear, 16, 14) == (1, [16, 1])  # not even 1 row: the caller refuses with its figures
    assert sizes(linear, 16, None) == (16, [])  # no limit: nothing to measure
    # Memory that grows faster than the rows (here far faster): the line's guesses stay below the
    # budget and climb from the nearest measured sizes, a bounded number of compiles.
    rows, tried = sizes(lambda rows: 10 + rows * rows, 16, 60)
    assert rows in (6, 7) and tried[:2] == [16, 1] and len(tried) <= 2 + 1 + MAX_REFINEMENTS
    rows, tried = sizes(lambda rows: 10 + 5 * rows + rows * rows // 8, 16, 60)  # nearly linear: 8 fits, 9 not
    assert rows == 8 and len(tried) <= 4


def test_a_trainer_naming_no_micro_batch_compiles_the_most_rows_that_fit(tmp_path):
    """The default micro_batch_tokens on a memory that holds only some of its rows: the trainer
    compiles fewer rows, as sizing chose."""
    directory = str(tmp_path / "model")
    write_hf_dir(directory, "llama")
    engine = Engine(engine_config(str(tmp_path / "jobs")), load_model(directory))
    stage = engine.runner.stages[0]
    spec = LoRASpec(4, 8.0, resolve_targets(None, engine.model_config.family))
    auto = dataclasses.replace(FAST, micro_batch_tokens=None)

    def compiled(rows, budget):
        trainer = LoRATrainer(stage.model, stage.params, spec, auto, (rows, 64), 10, stage.replicated, False, budget)
        return trainer, trainer.start_compiling().result()

    _, eight = compiled(8, None)
    trainer, memory = compiled(8, eight.total_bytes - 1)  # 8 rows no longer fit: the most that do
    assert 1 < memory.rows < 8 and trainer.micro_batch_shape == (memory.rows, 64)
    assert memory.total_bytes < eight.total_bytes


@pytest.mark.slow  # ~70 s on a busy 2-core machine: three sizes of the job's programs, the lent pool's and the steps
def test_a_job_with_the_defaults_trains_in_the_rows_that_fit(tmp_path):
    """32 rows of 64 tokens planned (DEFAULT_MICRO_BATCH_TOKENS) on a memory that holds fewer: the job
    compiles the most that fit, says so, and succeeds."""
    directory = str(tmp_path / "model")
    write_hf_dir(directory, "llama")
    probe = Engine(engine_config(str(tmp_path / "probe")), load_model(directory))
    stage = probe.runner.stages[0]
    spec = LoRASpec(4, 8.0, resolve_targets(None, probe.model_config.family))
    auto = dataclasses.replace(FAST, micro_batch_tokens=None, n_epochs=2)
    sizes = [LoRATrainer(stage.model, stage.params, spec, auto, (rows, 64), 10, stage.replicated, False,
                         None).start_compiling().result().total_bytes for rows in (8, 1)]
    engine = Engine(engine_config(str(tmp_path / "jobs"), memory_gib=sum(sizes) / 2 / GIB, remat=False),
                    load_model(directory))
    tuner = engine.fine_tuning
    job_id = tuner.create_job(upload(tuner, RECORDS), auto, rank=4)["id"]
    drive(engine, lambda: tuner.job(job_id)["status"] in ("succeeded", "failed"))
    assert tuner.job(job_id)["status"] == "succeeded", tuner.job(job_id)["error"]
    (event,) = [e for e in tuner.store.events(job_id) if e["message"].startswith("Compiled")]
    assert "(the most that fit)" in event["message"]
    assert event["data"]["micro_batch_tokens"] < DEFAULT_MICRO_BATCH_TOKENS
