"""The engine's fine-tuning jobs: the queue, the running job's trainer, checkpoints, and the finished
adapters served through the LoRA slots.

Jobs run one at a time, in creation order. A job's dataset is tokenized and its two programs compiled
on threads of their own (serving goes on meanwhile); the engine thread then runs its iterations when
Deferred Continuous Batching allows (`maybe_run`, deferral.py). With the KV pool lending its pages
(kv_loan.py), a job starts once it has borrowed them, and parks (its state on the host) whenever the
engine needs them back (`yield_memory`); its next turn borrows them again and goes on where it was.
Everything else about a job (events, checkpoints, the final peft directory and its registration with
the LoRA manager) happens on the engine thread too, so no request ever sees a half-registered adapter;
its status may also change on the thread reading its file or a caller's that cancels it, always under
the lock. Other threads read jobs only through snapshots (`job`, `jobs`), under the lock.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from orca_jax.config import FineTuningConfig, ModelConfig
from orca_jax.finetune.adapter_params import init_adapter, read_peft, save_peft
from orca_jax.finetune.data import TrainingPlan, read_jsonl
from orca_jax.finetune.deferral import DeferralPolicy
from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters, resolve_targets
from orca_jax.finetune.jobs import FineTuningJob, JobStatus, JobStore, new_id
from orca_jax.finetune.model import host_batch
from orca_jax.finetune.trainer import LoRATrainer, ParkedState, TrainerMemory
from orca_jax.kv_loan import KVLoan
from orca_jax.lora.manager import LoRAManager
from orca_jax.lora.request import LoRARequest
from orca_jax.request import Request

log = logging.getLogger(__name__)
GIB = 2**30
DEFAULT_RANK = 16


def default_directory() -> str:
    """$ORCA_JAX_FINE_TUNING_DIR, else ~/.cache/orca_jax/fine_tuning."""
    return os.environ.get("ORCA_JAX_FINE_TUNING_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "orca_jax", "fine_tuning")


@dataclasses.dataclass
class _Run:
    """The running job: its plan, trainer, and where it stands inside the current step."""

    job: FineTuningJob
    plan: TrainingPlan
    trainer: LoRATrainer
    compiled: concurrent.futures.Future  # -> TrainerMemory
    ready: bool = False
    batches: list = dataclasses.field(default_factory=list)  # the current step's micro-batches left
    step_loss: float = 0.0
    step_learned: float = 0.0  # completion tokens of the current step so far
    step_tokens: int = 0
    saved_step: int = 0  # optimizer step of the newest checkpoint
    memory_checked: bool = False  # its compiled memory fits memory_gib (checked once)
    parked: ParkedState | None = None  # its state while it gave the KV pool's pages back
    waiting_for_pages: bool = False  # told the job's events that requests hold the pages it borrows


class FineTuner:
    """Fine-tuning jobs of one engine (see the module doc)."""

    def __init__(self, config: FineTuningConfig, stage, model_config: ModelConfig, tokenizer, lora: LoRAManager,
                 base_model: str, max_len: int, loan: KVLoan | None = None):
        """`stage`: the runner's one stage (its decoder, served params and sharding); `loan`: the KV
        pool's lendable pages (None: the job's memory was held back from the pool at start)."""
        self.config = config
        self.store = JobStore(config.directory or default_directory())
        self.policy = DeferralPolicy(config.deferral_bound_s, max_inference_slowdown=config.max_inference_slowdown,
                                     tpot_slo_s=None if config.tpot_slo_ms is None else config.tpot_slo_ms / 1e3)
        self._stage, self._model_config, self._tokenizer = stage, model_config, tokenizer
        self._lora, self.base_model, self._max_len = lora, base_model, max_len
        self._loan = loan
        self.parks = 0  # times a running job gave its memory back to inference, since start
        self._lock = threading.Lock()
        self._jobs: dict[str, FineTuningJob] = {}
        self._plans: dict[str, TrainingPlan] = {}  # prepared datasets of queued jobs
        self._served: dict[str, LoRARequest] = {}  # fine_tuned_model -> its adapter, for the server
        self._run: _Run | None = None
        self._wakeup: Callable[[], None] = lambda: None
        self._preparer = concurrent.futures.ThreadPoolExecutor(1, "orca-finetune-data")
        for job in self.store.load_jobs():
            self._restore(job)

    # ---- reading (any thread) ----------------------------------------------------------------------
    def job(self, job_id: str) -> dict | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.to_openai()

    def jobs(self) -> list[dict]:
        """Every job, newest first."""
        with self._lock:
            return [job.to_openai() for job in sorted(self._jobs.values(), key=lambda j: (-j.created_at, j.id))]

    def checkpoints(self, job_id: str) -> list[dict] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else [dict(c) for c in reversed(job.checkpoints)]

    def served(self) -> dict[str, LoRARequest]:
        """fine_tuned_model -> its adapter, for every succeeded job."""
        with self._lock:
            return dict(self._served)

    def jobs_by_status(self) -> dict[str, int]:
        with self._lock:
            counts = {status.value: 0 for status in JobStatus}
            for job in self._jobs.values():
                counts[job.status.value] += 1
            return counts

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """Called (from other threads) when background work made a job runnable."""
        self._wakeup = wakeup

    # ---- jobs (engine thread) -----------------------------------------------------------------------
    def create_job(self, training_file: str, hyperparameters: TrainingHyperparameters, *, model: str | None = None,
                   rank: int | None = None, alpha: float | None = None,
                   target_modules: tuple[str, ...] | None = None, suffix: str | None = None) -> dict:
        """Queue a job on an uploaded file; `model` the base (None) or a served adapter to continue
        training (its rank, alpha and targets then apply). rank None: 16, or the server's maximum if
        lower; alpha None: 2 x rank; target_modules None: every projection. ValueError naming what is
        wrong."""
        if self.store.file_info(training_file) is None:
            raise ValueError(f"no file {training_file!r} (upload it with purpose 'fine-tune')")
        continue_from = None
        if model is None or model == self.base_model:
            rank = min(DEFAULT_RANK, self._lora.config.max_lora_rank) if rank is None else rank
            spec = LoRASpec(rank, 2.0 * rank if alpha is None else alpha,
                            resolve_targets(target_modules, self._model_config.family))
        else:
            adapter = next((lora for lora in self._lora.list() if lora.lora_name == model), None)
            if adapter is None:
                raise ValueError(f"model {model!r} is neither the base model {self.base_model!r} nor a served adapter")
            _, spec = read_peft(adapter.lora_path, model, self._model_config)
            continue_from = adapter.lora_path
        if spec.rank > self._lora.config.max_lora_rank:
            raise ValueError(f"LoRA rank {spec.rank} is above the server's maximum ({self._lora.config.max_lora_rank}; "
                             "see --max-lora-rank), so the result could not be served")
        job = FineTuningJob(new_id("ftjob"), model or self.base_model, training_file, spec, hyperparameters,
                            int(time.time()), suffix, continue_from)
        with self._lock:
            self._jobs[job.id] = job
        self._save(job)
        self.store.add_event(job.id, f"Created fine-tuning job: {job.id}")
        self._preparer.submit(self._prepare, job)
        return job.to_openai()

    def cancel(self, job_id: str) -> dict:
        """Cancel a job (KeyError if unknown; ValueError if it already ended)."""
        job = self._jobs[job_id]
        if job.status.finished:
            raise ValueError(f"job {job_id} has already {job.status.value}")
        if self._run is not None and self._run.job is job:
            self._end_run()
        self._set(job, JobStatus.CANCELLED, finished_at=int(time.time()))
        self.store.add_event(job.id, "Fine-tuning job cancelled")
        return job.to_openai()

    def has_work(self) -> bool:
        """Whether maybe_run would do something now (a compiling job waits: the wakeup says when)."""
        with self._lock:
            if self._run is not None:
                return self._run.ready or (self._run.compiled.done() and self._loan_prepared())
            return any(job.id in self._plans for job in self._jobs.values() if job.status is JobStatus.QUEUED)

    def maybe_run(self, oldest_waiting_arrival: float | None, now: float) -> bool:
        """One fine-tuning turn, if Deferred Continuous Batching allows it now (the engine asks only
        while no inference request runs); False: inference goes first."""
        self.policy.idle()
        if not self.policy.may_run(oldest_waiting_arrival, now):
            return False
        self._turn(deferred=oldest_waiting_arrival is not None)
        return True

    def maybe_run_beside(self, now: float, requests: Callable[[], Iterable[Request]] = tuple) -> bool:
        """While requests run: one iteration if the policy allows it (`requests`: the unfinished ones,
        for a TPOT SLO), for a job ready to iterate or parked (a job starts in idle turns; under a TPOT
        SLO it also resumes only there: ~0.6 s for llama-8b, the pages and the state, that no request's
        slack covers)."""
        run = self._run
        resumable = run is not None and run.parked is not None and self.policy.tpot_slo_s is None
        if run is None or not (run.ready or resumable) or not self.policy.may_run_beside(now, requests):
            return False
        self._turn(beside=True)
        return True

    def yield_memory(self) -> bool:
        """Inference needs the KV pages the running job borrowed: the job parks (its state copied to
        the host, its device arrays freed) and the pool takes them back. False: nothing was lent."""
        if self._loan is None or not self._loan.lent:
            return False
        run = self._run
        if run is not None and run.ready:
            run.parked = run.trainer.park()
            run.ready = False
            self.parks += 1
            self.store.add_event(run.job.id, f"Paused at step {run.job.step}: requests need the KV pages the "
                                             "job borrowed; it goes on once they are free again")
        self._loan.reclaim()
        return True

    def _turn(self, deferred: bool = False, beside: bool = False) -> None:
        run = self._run
        try:
            if run is None:
                self._start_next()
            elif not run.ready:
                start = time.perf_counter()
                self._become_ready(run)
                if beside:  # a resume's copies stalled the running requests: paid like an iteration
                    self.policy.debit(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                tokens = self._iterate(run)
                self.policy.record(time.perf_counter() - start, tokens, deferred, beside)
        except Exception as error:  # a job's failure is the job's, never the server's
            job = run.job if run is not None else None
            log.exception("fine-tuning job %s failed", job.id if job else "?")
            if job is not None:
                self._fail(job, "training_error", f"{type(error).__name__}: {error}")

    def suspend(self) -> None:
        """The engine stops: checkpoint the running job's last finished step, so it resumes there."""
        run = self._run
        if run is not None and (run.ready or run.parked is not None) and run.job.step > run.saved_step:
            self._checkpoint(run)

    # ---- inside ------------------------------------------------------------------------------------
    def _save(self, job: FineTuningJob) -> None:
        self.store.save_job(job, self._lock)  # its snapshot taken under the lock its changes hold

    def _set(self, job: FineTuningJob, status: JobStatus, **fields) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(job, name, value)
            job.status = status
        self._save(job)

    def _prepare(self, job: FineTuningJob) -> None:
        """On the data thread: tokenize the dataset and plan the steps; the job is then queued."""
        try:
            examples = read_jsonl(self.store.read_file(job.training_file), self._tokenizer, self._max_len)
            hp = job.hyperparameters
            plan = TrainingPlan.make(examples, hp.batch_size, hp.n_epochs, hp.seed, hp.micro_batch_tokens, self._max_len)
        except Exception as error:
            self._fail(job, "invalid_training_file", str(error), "training_file")
            return
        with self._lock:
            if job.status.finished:  # cancelled meanwhile
                return
            self._plans[job.id] = plan
            job.total_steps = plan.total_steps
            validated, job.status = job.status is JobStatus.VALIDATING_FILES, JobStatus.QUEUED
        self._save(job)
        if validated:
            self.store.add_event(job.id, f"Validated the training file: {len(examples)} examples, "
                                         f"{plan.total_steps} steps")
        self._wakeup()

    def _start_next(self) -> None:
        with self._lock:
            job = next((j for j in sorted(self._jobs.values(), key=lambda j: (j.created_at, j.id))
                        if j.status is JobStatus.QUEUED and j.id in self._plans), None)
            if job is None:
                return
            plan = self._plans.pop(job.id)
        stage, hp = self._stage, job.hyperparameters
        trainer = LoRATrainer(stage.model, stage.params, job.lora, hp, (plan.rows, plan.length), plan.total_steps,
                              stage.replicated, self.config.remat, int(self.config.memory_gib * GIB))
        compiled = trainer.start_compiling()
        compiled.add_done_callback(lambda _: self._wakeup())
        if self._loan is not None:  # the smaller pool's programs, compiled alongside (once per engine)
            self._loan.prepare().add_done_callback(lambda _: self._wakeup())
        self._run = _Run(job, plan, trainer, compiled)
        self._set(job, JobStatus.RUNNING)
        self.store.add_event(job.id, f"Fine-tuning job started ({plan.rows} rows x {plan.length} tokens "
                                     "per iteration)")

    def _loan_prepared(self) -> bool:
        return self._loan is None or self._loan.prepare().done()

    def _become_ready(self, run: _Run) -> None:
        """Its programs are compiled: check its memory (once), borrow the KV pool's pages (when it
        lends them), then put its state on the device: fresh, from a checkpoint, or as it parked."""
        if not run.memory_checked and not self._check_memory(run):
            return
        if self._loan is not None and not self._loan.lend():
            if not run.waiting_for_pages:
                run.waiting_for_pages = True
                self.store.add_event(run.job.id, "Waiting for the KV pages the job borrows: requests hold them")
            return
        run.waiting_for_pages = False
        if run.parked is not None:
            run.trainer.unpark(run.parked)
            run.parked = None
            self.store.add_event(run.job.id, f"Resumed at step {run.job.step}")
        else:
            self._init_state(run)
        run.ready = True

    def _check_memory(self, run: _Run) -> bool:
        memory: TrainerMemory = run.compiled.result()
        source = "lent by the KV pool" if self._loan is not None else "held back from the KV pool"
        if memory.total_bytes > self.config.memory_gib * GIB:
            self._fail(run.job, "insufficient_memory",
                       f"the job needs {memory.total_bytes / GIB:.2f} GiB of device memory "
                       f"({memory.state_bytes / GIB:.2f} GiB adapter and optimizer state, "
                       f"{memory.temp_bytes / GIB:.2f} GiB activations of one iteration) but "
                       f"{self.config.memory_gib:.2f} GiB is {source} for fine-tuning (--fine-tuning-memory-gib); "
                       "lower micro_batch_tokens or the LoRA rank, or raise --fine-tuning-memory-gib")
            return False
        self.store.add_event(run.job.id, f"Compiled; the job needs {memory.total_bytes / GIB:.2f} GiB of device "
                                         f"memory ({memory.state_bytes / GIB:.2f} GiB state, "
                                         f"{memory.temp_bytes / GIB:.2f} GiB activations, "
                                         f"{'recomputed' if memory.remat else 'kept'} for the backward) of the "
                                         f"{self.config.memory_gib:.2f} GiB {source}",
                             data={"state_bytes": memory.state_bytes, "temp_bytes": memory.temp_bytes,
                                   "batch_bytes": memory.batch_bytes, "remat": memory.remat})
        run.memory_checked = True
        return True

    def _init_state(self, run: _Run) -> None:
        job, hp = run.job, run.job.hyperparameters
        if job.checkpoints:
            newest = job.checkpoints[-1]
            adapter, _ = read_peft(newest["path"], job.id, self._model_config)
            with np.load(os.path.join(newest["path"], "optimizer.npz")) as saved:
                leaves = [saved[str(i)] for i in range(len(saved.files))]
            run.trainer.init_state(adapter, leaves, newest["step_number"])
            run.saved_step = newest["step_number"]
            with self._lock:
                job.step = newest["step_number"]
                job.trained_tokens = newest["trained_tokens"]
            self.store.add_event(job.id, f"Resumed from the checkpoint of step {job.step}")
        else:
            with self._lock:  # a restart before the first checkpoint: from the start again
                job.step = job.trained_tokens = 0
            start = read_peft(job.continue_from, job.model, self._model_config)[0] if job.continue_from \
                else init_adapter(self._model_config, job.lora, hp.seed)
            run.trainer.init_state(start)
        run.trainer.warm_up()  # a first run's one-off costs stay out of the iteration estimate

    def _iterate(self, run: _Run) -> int:
        """One micro-batch forward and backward (waited for), and the optimizer step after a step's
        last; returns the tokens the forward ran over."""
        job = run.job
        if not run.batches:
            run.batches = run.plan.micro_batches(job.step)
            run.step_loss = run.step_learned = run.step_tokens = 0
        arrays = run.batches.pop(0)
        loss, learned = run.trainer.micro_step(host_batch(**arrays))
        tokens = int(np.count_nonzero(arrays["segment_ids"]))
        run.step_loss += float(loss)  # waits for the device: the iteration ends when its work does
        run.step_learned += float(learned)
        run.step_tokens += tokens
        if run.batches:
            return tokens
        norm, rate = run.trainer.apply_step(run.step_learned)
        train_loss = run.step_loss / max(run.step_learned, 1.0)
        with self._lock:
            job.step += 1
            job.trained_tokens += run.step_tokens
            job.train_loss = train_loss
        self.store.add_event(job.id, f"Step {job.step}/{job.total_steps}: training loss={train_loss:.4f}",
                             data={"step": job.step, "total_steps": job.total_steps, "train_loss": train_loss,
                                   "learning_rate": rate, "grad_norm": norm})
        if self._checkpoint_due(run):
            self._checkpoint(run)
        if job.step >= job.total_steps:
            self._finish(run)
        return tokens

    def _checkpoint_due(self, run: _Run) -> bool:
        every = run.job.hyperparameters.checkpoint_every or run.plan.steps_per_epoch
        return run.job.step % every == 0 or run.job.step >= run.job.total_steps

    def _checkpoint(self, run: _Run) -> None:
        """The adapter (peft) and AdamW's state at the current step; the oldest beyond keep_checkpoints go."""
        job = run.job
        path = self.store.checkpoint_dir(job.id, job.step)
        adapter, opt_leaves = run.trainer.state_to_host(run.parked)
        save_peft(path, adapter, job.lora, self._model_config, self.base_model)
        np.savez(os.path.join(path, "optimizer.npz"), **{str(i): leaf for i, leaf in enumerate(opt_leaves)})
        checkpoint = {"object": "fine_tuning.job.checkpoint", "id": new_id("ftckpt"), "created_at": int(time.time()),
                      "fine_tuning_job_id": job.id, "step_number": job.step, "trained_tokens": job.trained_tokens,
                      "fine_tuned_model_checkpoint": f"{self._model_name(job)}:ckpt-step-{job.step}",
                      "metrics": {"step": job.step}, "path": path}
        with open(os.path.join(path, "state.json"), "w", encoding="utf-8") as f:
            json.dump(checkpoint, f)
        with self._lock:
            job.checkpoints.append(checkpoint)
            dropped = job.checkpoints[:-self.config.keep_checkpoints]
            del job.checkpoints[:-self.config.keep_checkpoints]
        self._save(job)
        for old in dropped:
            self.store.drop_checkpoint(old["path"])
        run.saved_step = job.step

    def _model_name(self, job: FineTuningJob) -> str:
        """OpenAI's shape, ft:<model>[:<suffix>]:<id>, where model is what the job started from."""
        return ":".join(["ft", job.model, *([job.suffix] if job.suffix else []), job.id.removeprefix("ftjob-")[:8]])

    def _finish(self, run: _Run) -> None:
        """Save the peft directory and serve it under the job's fine_tuned_model at once."""
        job = run.job
        path = self.store.adapter_dir(job.id)
        adapter, _ = run.trainer.state_to_host()
        save_peft(path, adapter, job.lora, self._model_config, self.base_model)
        self._end_run()
        name = self._model_name(job)
        self._serve(LoRARequest(name, self._lora.new_id(), path))
        self._set(job, JobStatus.SUCCEEDED, fine_tuned_model=name, finished_at=int(time.time()))
        self.store.add_event(job.id, f"The job has successfully completed: {name}")

    def _serve(self, lora: LoRARequest) -> None:
        self._lora.add(lora)
        with self._lock:
            self._served[lora.lora_name] = lora

    def _end_run(self) -> None:
        run, self._run = self._run, None
        if run is not None and run.ready:
            run.trainer.release()
        if self._loan is not None:
            self._loan.reclaim()

    def _fail(self, job: FineTuningJob, code: str, message: str, param: str | None = None) -> None:
        if self._run is not None and self._run.job is job:
            self._end_run()
        self._set(job, JobStatus.FAILED, error={"code": code, "message": message, "param": param},
                  finished_at=int(time.time()))
        self.store.add_event(job.id, f"Fine-tuning job failed: {message}", level="error")

    def _restore(self, job: FineTuningJob) -> None:
        """A job found on disk at start: serve it if it succeeded, queue it again if it had not ended."""
        self._jobs[job.id] = job
        if job.status is JobStatus.SUCCEEDED:
            try:
                self._serve(LoRARequest(job.fine_tuned_model, self._lora.new_id(), self.store.adapter_dir(job.id)))
            except ValueError as error:
                log.warning("fine-tuned model %s cannot be served: %s", job.fine_tuned_model, error)
        elif not job.status.finished:
            if job.status is JobStatus.RUNNING:
                self.store.add_event(job.id, "The server restarted; the job resumes from its newest checkpoint")
            job.status = JobStatus.QUEUED
            self._save(job)
            self._preparer.submit(self._prepare, job)
