"""The running fine-tuning job, on the engine thread: its trainer, where it stands inside the current
step, and what it does with them: check its compiled memory, put its state on the device (fresh, from a
checkpoint, or as it parked), run one micro-batch, end a step, write a checkpoint, park.

The tuner (tuner.py) decides when a run may do these (the KV pool's pages it borrows included), and
owns what a run ends in: the job's queue, its finish and its failure. A run changes its job's fields
under the tuner's lock (`RunContext.lock`), as every writer of a job does (jobs.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import threading
import time

import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.finetune.adapter_params import init_adapter, read_peft, save_peft
from orca_jax.finetune.data import TrainingPlan
from orca_jax.finetune.jobs import FineTuningJob, JobStore, fine_tuned_model_name, new_id
from orca_jax.finetune.model import host_batch
from orca_jax.finetune.trainer import LoRATrainer, ParkedState, TrainerMemory

GIB = 2**30


class TrainingDiverged(ArithmeticError):
    """A step's loss or gradient went non-finite: the job fails rather than train (and serve) NaN."""


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a run shares with its tuner."""

    store: JobStore
    lock: threading.Lock  # the tuner's: every change to a job is made under it
    model_config: ModelConfig
    base_model: str
    keep_checkpoints: int

    def save(self, job: FineTuningJob) -> None:
        self.store.save_job(job, self.lock)  # its snapshot taken under the lock its changes hold


@dataclasses.dataclass
class JobRun:
    """The running job: its plan, trainer, and where it stands inside the current step."""

    job: FineTuningJob
    plan: TrainingPlan
    trainer: LoRATrainer
    compiled: concurrent.futures.Future  # -> TrainerMemory
    context: RunContext
    ready: bool = False
    batches: list = dataclasses.field(default_factory=list)  # the current step's micro-batches left
    step_loss: float = 0.0
    step_learned: float = 0.0  # completion tokens of the current step so far
    step_tokens: int = 0
    saved_step: int = 0  # optimizer step of the newest checkpoint
    memory_checked: bool = False  # its compiled memory fits memory_gib (checked once)
    parked: ParkedState | None = None  # its state while it gave the KV pool's pages back
    waiting_for_pages: bool = False  # told the job's events that requests hold the pages it borrows

    def check_memory(self, memory_gib: float, source: str) -> str | None:
        """Once compiled: why its memory cannot fit the `memory_gib` `source` (lent by / held back from
        the KV pool) gives fine-tuning; else None, after an event saying what it needs."""
        memory: TrainerMemory = self.compiled.result()
        sized = self.job.hyperparameters.micro_batch_tokens is None  # the rows were chosen to fit
        if memory.total_bytes > memory_gib * GIB:
            lower = "the LoRA rank" if sized else "micro_batch_tokens or the LoRA rank"
            return (f"the job needs {memory.total_bytes / GIB:.2f} GiB of device memory "
                    f"({memory.state_bytes / GIB:.2f} GiB adapter and optimizer state, "
                    f"{memory.temp_bytes / GIB:.2f} GiB activations of one iteration of "
                    f"{memory.rows} x {self.plan.length} tokens) but "
                    f"{memory_gib:.2f} GiB is {source} for fine-tuning (--fine-tuning-memory-gib); "
                    f"lower {lower}, or raise --fine-tuning-memory-gib")
        # The plan's micro-batches take the rows compiled (sizing may have chosen fewer than planned):
        # a step's gradient is the same whatever their number.
        self.plan = dataclasses.replace(self.plan, rows=memory.rows)
        self.context.store.add_event(
            self.job.id, f"Compiled; the job needs {memory.total_bytes / GIB:.2f} GiB of device memory "
                         f"({memory.state_bytes / GIB:.2f} GiB state, {memory.temp_bytes / GIB:.2f} GiB activations, "
                         f"{'recomputed' if memory.remat else 'kept'} for the backward) of the "
                         f"{memory_gib:.2f} GiB {source}; micro-batches of {memory.rows} x {self.plan.length} tokens"
                         + (" (the most that fit)" if sized else ""),
            data={"state_bytes": memory.state_bytes, "temp_bytes": memory.temp_bytes,
                  "batch_bytes": memory.batch_bytes, "remat": memory.remat,
                  "micro_batch_tokens": memory.rows * self.plan.length})
        self.memory_checked = True
        return None

    def wait_for_pages(self) -> None:
        """The KV pool could not lend the pages the job borrows (requests hold them): said once."""
        if not self.waiting_for_pages:
            self.waiting_for_pages = True
            self.context.store.add_event(self.job.id, "Waiting for the KV pages the job borrows: requests hold them")

    def become_ready(self) -> None:
        """Its state on the device, as it parked or else new (init_state): it may iterate."""
        self.waiting_for_pages = False
        if self.parked is not None:
            self.trainer.unpark(self.parked)
            self.parked = None
            self.context.store.add_event(self.job.id, f"Resumed at step {self.job.step}")
        else:
            self.init_state()
        self.ready = True

    def park(self) -> None:
        """Its state to the host and its device arrays freed (the KV pool takes its pages back);
        become_ready puts it back exactly as it was."""
        self.parked = self.trainer.park()
        self.ready = False
        self.context.store.add_event(self.job.id, f"Paused at step {self.job.step}: requests need the KV pages "
                                                  "the job borrowed; it goes on once they are free again")

    def init_state(self) -> None:
        """Its state on the device: from its newest checkpoint, else from the adapter it continues or
        a fresh one."""
        job, context = self.job, self.context
        if job.checkpoints:
            newest = job.checkpoints[-1]
            adapter, _ = read_peft(newest["path"], job.id, context.model_config)
            with np.load(os.path.join(newest["path"], "optimizer.npz")) as saved:
                leaves = [saved[str(i)] for i in range(len(saved.files))]
            self.trainer.init_state(adapter, leaves, newest["step_number"])
            self.saved_step = newest["step_number"]
            with context.lock:
                job.step = newest["step_number"]
                job.trained_tokens = newest["trained_tokens"]
            context.store.add_event(job.id, f"Resumed from the checkpoint of step {job.step}")
        else:
            with context.lock:  # a restart before the first checkpoint: from the start again
                job.step = job.trained_tokens = 0
            start = read_peft(job.continue_from, job.model, context.model_config)[0] if job.continue_from \
                else init_adapter(context.model_config, job.lora, job.hyperparameters.seed)
            self.trainer.init_state(start)
        self.trainer.warm_up()  # a first run's one-off costs stay out of the iteration estimate

    def iterate(self) -> tuple[int, bool]:
        """One micro-batch forward and backward (waited for), and the optimizer step (with its event,
        and a checkpoint when due) after a step's last; returns the tokens the forward ran over, and
        whether that step was the job's last."""
        job = self.job
        if not self.batches:
            self.batches = self.plan.micro_batches(job.step)
            self.step_loss = self.step_learned = self.step_tokens = 0
        arrays = self.batches.pop(0)
        loss, learned = self.trainer.micro_step(host_batch(**arrays))
        tokens = int(np.count_nonzero(arrays["segment_ids"]))
        self.step_loss += float(loss)  # waits for the device: the iteration ends when its work does
        self.step_learned += float(learned)
        self.step_tokens += tokens
        if self.batches:
            return tokens, False
        self._end_step()
        return tokens, self.job.step >= self.job.total_steps

    def _end_step(self) -> None:
        job = self.job
        train_loss = self.step_loss / max(self.step_learned, 1.0)
        if not math.isfinite(train_loss):  # before the step: the adapter it would write is lost anyway
            raise TrainingDiverged(f"the training loss of step {job.step + 1} is not finite (training diverged); "
                                   "try a lower learning_rate_multiplier")
        norm, rate = self.trainer.apply_step(self.step_learned)
        if not math.isfinite(norm):
            raise TrainingDiverged(f"the gradient norm of step {job.step + 1} is not finite (training diverged); "
                                   "try a lower learning_rate_multiplier")
        with self.context.lock:
            job.step += 1
            job.trained_tokens += self.step_tokens
            job.train_loss = train_loss
        self.context.store.add_event(job.id, f"Step {job.step}/{job.total_steps}: training loss={train_loss:.4f}",
                                     data={"step": job.step, "total_steps": job.total_steps,
                                           "train_loss": train_loss, "learning_rate": rate, "grad_norm": norm})
        every = job.hyperparameters.checkpoint_every or self.plan.steps_per_epoch
        if job.step % every == 0 or job.step >= job.total_steps:
            self.checkpoint()

    def checkpoint(self) -> None:
        """The adapter (peft) and AdamW's state at the current step; the oldest beyond keep_checkpoints go."""
        job, context = self.job, self.context
        path = context.store.checkpoint_dir(job.id, job.step)
        adapter, opt_leaves = self.trainer.state_to_host(self.parked)
        save_peft(path, adapter, job.lora, context.model_config, context.base_model)
        np.savez(os.path.join(path, "optimizer.npz"), **{str(i): leaf for i, leaf in enumerate(opt_leaves)})
        checkpoint = {"object": "fine_tuning.job.checkpoint", "id": new_id("ftckpt"), "created_at": int(time.time()),
                      "fine_tuning_job_id": job.id, "step_number": job.step, "trained_tokens": job.trained_tokens,
                      "fine_tuned_model_checkpoint": f"{fine_tuned_model_name(job)}:ckpt-step-{job.step}",
                      "metrics": {"step": job.step}, "path": path}
        with open(os.path.join(path, "state.json"), "w", encoding="utf-8") as f:
            json.dump(checkpoint, f)
        with context.lock:
            job.checkpoints.append(checkpoint)
            dropped = job.checkpoints[:-context.keep_checkpoints]
            del job.checkpoints[:-context.keep_checkpoints]
        context.save(job)
        for old in dropped:
            context.store.drop_checkpoint(old["path"])
        self.saved_step = job.step

    def save_adapter(self) -> str:
        """The trained adapter as a peft directory (the job's adapter dir); returns its path."""
        path = self.context.store.adapter_dir(self.job.id)
        adapter, _ = self.trainer.state_to_host()
        save_peft(path, adapter, self.job.lora, self.context.model_config, self.context.base_model)
        return path
