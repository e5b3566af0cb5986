"""LLM.fine_tune: one job run to its end on the offline engine, with a progress bar."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Iterable

from orca_jax.progress import tqdm

from orca_jax.finetune.data import read_jsonl
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.lora.request import LoRARequest

if TYPE_CHECKING:
    from orca_jax.engine import Engine

IDLE_SLEEP_S = 0.005  # while the job's data or programs are prepared on their threads


def dataset_bytes(dataset: str | os.PathLike | Iterable[dict]) -> tuple[bytes, str]:
    """(JSONL bytes, file name) of a path or of records."""
    if isinstance(dataset, (str, os.PathLike)):
        with open(dataset, "rb") as f:
            return f.read(), os.path.basename(os.fspath(dataset))
    return "".join(json.dumps(record) + "\n" for record in dataset).encode("utf-8"), "records.jsonl"


def run_fine_tune(engine: Engine, dataset, *, hyperparameters: TrainingHyperparameters,
                  lora_request: LoRARequest | None, rank: int | None, alpha: float | None,
                  target_modules: tuple[str, ...] | None, suffix: str | None, use_tqdm: bool) -> LoRARequest:
    """Create a job on `dataset` and step the engine until it ends; its adapter, served already."""
    tuner = engine.fine_tuning
    if tuner is None:
        raise ValueError("fine-tuning is not enabled (LLM(enable_fine_tuning=True), EngineConfig.fine_tuning)")
    data, name = dataset_bytes(dataset)
    read_jsonl(data, engine.tokenizer, engine.max_model_len,  # the first bad line, before anything is kept
               max_messages=tuner.config.max_example_messages)
    file_id = tuner.store.save_file(data, name, "fine-tune")["id"]
    model = None
    if lora_request is not None:
        engine.add_lora(lora_request)
        model = lora_request.lora_name
    job_id = tuner.create_job(file_id, hyperparameters, model=model, rank=rank, alpha=alpha,
                              target_modules=target_modules, suffix=suffix)["id"]
    bar = tqdm(total=None, desc="fine-tuning", unit="step", disable=not use_tqdm)
    try:
        while not (job := tuner.job(job_id))["status"] in ("succeeded", "failed", "cancelled"):
            if bar.total is None and job["total_steps"]:
                bar.reset(total=job["total_steps"])
            if engine.has_work():
                engine.step()
            else:
                time.sleep(IDLE_SLEEP_S)
            if job["step"] > bar.n:
                bar.update(job["step"] - bar.n)
                bar.set_postfix(loss=f"{job['train_loss']:.4f}")
    except BaseException:
        if tuner.job(job_id)["status"] not in ("succeeded", "failed", "cancelled"):
            tuner.cancel(job_id)
        raise
    finally:
        bar.close()
    if job["status"] != "succeeded":
        raise RuntimeError(f"fine-tuning job {job_id} {job['status']}: {(job['error'] or {}).get('message')}")
    return tuner.served()[job["fine_tuned_model"]]
