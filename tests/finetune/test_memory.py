"""The job's memory: held back from a pool sized from free memory, and a job that needs more than
that is refused with the figures (checked by hand, and on a tiny model)."""

from __future__ import annotations

import dataclasses

from orca_jax.config import CacheConfig
from orca_jax.engine import Engine
from orca_jax.finetune.hparams import LoRASpec, resolve_targets
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
