"""A fine-tuning job as OpenAI describes one, its events and checkpoints, and where it all lives on
disk (no jax).

On disk, under the fine-tuning directory (FineTuningConfig.directory):
  files/<file id>.jsonl, files/<file id>.json         uploaded datasets and their metadata
  jobs/<job id>/job.json                               the job (rewritten whole, atomically, on change)
  jobs/<job id>/events.jsonl                           its events, appended (loss per step)
  jobs/<job id>/checkpoints/step-<n>/                  peft adapter + optimizer.npz + state.json:
                                                       the newest FineTuningConfig.keep_checkpoints kept
  jobs/<job id>/adapter/                               the finished adapter (peft), served as
                                                       fine_tuned_model
A job found queued or running at start-up resumes from its newest checkpoint (or from the start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import secrets
import shutil
import threading
import time
from typing import BinaryIO

from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters
from orca_jax.json_limits import finite_or_none

log = logging.getLogger(__name__)
COPY_CHUNK_BYTES = 1 << 20


class JobStatus(enum.Enum):
    """OpenAI's job states."""

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclasses.dataclass
class FineTuningJob:
    """One job; mutated under its FineTuner's lock (by the engine thread, the thread reading its file, or
    a caller cancelling it), read anywhere through `snapshot`."""

    id: str
    model: str  # the base model's served name, or the adapter continued
    training_file: str
    lora: LoRASpec
    hyperparameters: TrainingHyperparameters
    created_at: int
    suffix: str | None = None
    continue_from: str | None = None  # the continued adapter's peft directory
    status: JobStatus = JobStatus.VALIDATING_FILES
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    error: dict | None = None  # {"code", "message", "param"} once failed
    trained_tokens: int = 0
    step: int = 0  # optimizer steps done
    total_steps: int = 0
    train_loss: float | None = None  # the last step's
    checkpoints: list[dict] = dataclasses.field(default_factory=list)  # OpenAI checkpoint objects + "path"

    def to_openai(self) -> dict:
        """The fine_tuning.job object (OpenAI's fields, plus the LoRA settings and progress); JSON has no
        NaN, so a non-finite number (a diverged loss) is null."""
        hp = self.hyperparameters
        hyper = {"n_epochs": hp.n_epochs, "batch_size": hp.batch_size,
                 "learning_rate_multiplier": finite_or_none(hp.learning_rate_multiplier)}
        return {"object": "fine_tuning.job", "id": self.id, "model": self.model, "created_at": self.created_at,
                "finished_at": self.finished_at, "fine_tuned_model": self.fine_tuned_model,
                "organization_id": "orca_jax", "result_files": [], "status": self.status.value,
                "validation_file": None, "training_file": self.training_file, "hyperparameters": hyper,
                "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
                "trained_tokens": self.trained_tokens if self.status is JobStatus.SUCCEEDED else None,
                "error": self.error, "seed": hp.seed, "estimated_finish": None, "integrations": [],
                "metadata": None, "user_provided_suffix": self.suffix,
                "lora": {"rank": self.lora.rank, "alpha": finite_or_none(self.lora.alpha),
                         "target_modules": list(self.lora.target_modules)},
                "step": self.step, "total_steps": self.total_steps, "train_loss": finite_or_none(self.train_loss)}

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "status": self.status.value}

    @classmethod
    def from_json(cls, data: dict) -> "FineTuningJob":
        lora = data.pop("lora")
        lora["target_modules"] = tuple(lora["target_modules"])
        return cls(lora=LoRASpec(**lora), hyperparameters=TrainingHyperparameters(**data.pop("hyperparameters")),
                   status=JobStatus(data.pop("status")), **data)


def fine_tuned_model_name(job: FineTuningJob) -> str:
    """OpenAI's shape, ft:<model>[:<suffix>]:<id>, where model is what the job started from."""
    return ":".join(["ft", job.model, *([job.suffix] if job.suffix else []), job.id.removeprefix("ftjob-")[:8]])


def _write_json(path: str, data) -> None:
    """Write `data` to `path` atomically: readers see the old file or the new one, never a part."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # writers in two threads each have their own
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class JobStore:
    """The fine-tuning directory: uploaded files, jobs, events, checkpoints (see the module doc)."""

    def __init__(self, root: str):
        self.root = root
        self.files_dir = os.path.join(root, "files")
        self.jobs_dir = os.path.join(root, "jobs")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.jobs_dir, exist_ok=True)
        self._lock = threading.Lock()  # events are appended from the engine thread, read from others
        # A job is saved from the engine thread, the thread reading its file and the caller cancelling
        # it: one at a time, each writing the job as it is when its turn comes (so the newest state wins).
        self._save_lock = threading.Lock()

    # ---- files ---------------------------------------------------------------------------------------
    def save_file(self, data: bytes | BinaryIO, filename: str, purpose: str) -> dict:
        """Store an uploaded file (already checked; bytes, or a binary file copied from where it is in
        bounded memory); its OpenAI file object."""
        file_id = new_id("file")
        with open(os.path.join(self.files_dir, f"{file_id}.jsonl"), "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                shutil.copyfileobj(data, f, COPY_CHUNK_BYTES)
            size = f.tell()
        info = {"object": "file", "id": file_id, "bytes": size, "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        _write_json(os.path.join(self.files_dir, f"{file_id}.json"), info)
        return info

    def file_info(self, file_id: str) -> dict | None:
        path = os.path.join(self.files_dir, f"{os.path.basename(file_id)}.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def read_file(self, file_id: str) -> bytes:
        with open(os.path.join(self.files_dir, f"{os.path.basename(file_id)}.jsonl"), "rb") as f:
            return f.read()

    # ---- jobs ----------------------------------------------------------------------------------------
    def job_dir(self, job_id: str) -> str:
        return os.path.join(self.jobs_dir, os.path.basename(job_id))

    def save_job(self, job: FineTuningJob, job_lock: threading.Lock | None = None) -> None:
        """Write the job as it is now; `job_lock`: the lock its mutations hold (taken for the snapshot)."""
        with self._save_lock:
            with job_lock or contextlib.nullcontext():
                data = job.to_json()
            os.makedirs(self.job_dir(job.id), exist_ok=True)
            _write_json(os.path.join(self.job_dir(job.id), "job.json"), data)

    def load_jobs(self) -> list[FineTuningJob]:
        """Every job on disk that can be read back, oldest first. One that cannot (a settings value
        out of range, such as the NaN an older version let in, or a damaged file) is left out with
        a warning: it must not keep every other job from being listed, nor be resumed or served."""
        jobs = []
        for name in os.listdir(self.jobs_dir):
            path = os.path.join(self.jobs_dir, name, "job.json")
            if os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8") as f:
                        # NaN (an older version's diverged loss) reads as null; in a setting, it is refused.
                        jobs.append(FineTuningJob.from_json(json.load(f, parse_constant=lambda _: None)))
                except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
                    log.warning("fine-tuning job %s is left out: %s", path, error)
        return sorted(jobs, key=lambda job: (job.created_at, job.id))

    def add_event(self, job_id: str, message: str, level: str = "info", data: dict | None = None) -> dict:
        data = {key: finite_or_none(value) if isinstance(value, float) else value for key, value in (data or {}).items()}
        event = {"object": "fine_tuning.job.event", "id": new_id("ftevent"), "created_at": int(time.time()),
                 "level": level, "message": message, "data": data,
                 "type": "metrics" if data and "train_loss" in data else "message"}
        with self._lock, open(os.path.join(self.job_dir(job_id), "events.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
        return event

    def events(self, job_id: str) -> list[dict]:
        """The job's events, oldest first."""
        path = os.path.join(self.job_dir(job_id), "events.jsonl")
        if not os.path.isfile(path):
            return []
        with self._lock, open(path, encoding="utf-8") as f:
            # NaN written by an older version reads as null: JSON responses cannot carry it.
            return [json.loads(line, parse_constant=lambda _: None) for line in f if line.strip()]

    def checkpoint_dir(self, job_id: str, step: int) -> str:
        return os.path.join(self.job_dir(job_id), "checkpoints", f"step-{step:06d}")

    def adapter_dir(self, job_id: str) -> str:
        return os.path.join(self.job_dir(job_id), "adapter")

    def drop_checkpoint(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
