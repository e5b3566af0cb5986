"""The engine's fine-tuning jobs: the queue, the running job (job_run.py), and the finished
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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from orca_jax.config import FineTuningConfig, ModelConfig
from orca_jax.core.request import Request
from orca_jax.finetune.adapter_params import read_peft
from orca_jax.finetune.data import TrainingPlan, ValidationStopped, read_jsonl
from orca_jax.finetune.deferral import DeferralPolicy
from orca_jax.finetune.hparams import DEFAULT_MICRO_BATCH_TOKENS, LoRASpec, TrainingHyperparameters, resolve_targets
from orca_jax.finetune.job_run import GIB, JobRun, RunContext
from orca_jax.finetune.jobs import FineTuningJob, JobStatus, JobStore, fine_tuned_model_name, new_id
from orca_jax.finetune.kv_loan import KVLoan
from orca_jax.finetune.trainer import LoRATrainer
from orca_jax.lora.manager import LoRAManager
from orca_jax.lora.request import LoRARequest

log = logging.getLogger(__name__)
DEFAULT_RANK = 16


def default_directory() -> str:
    """$ORCA_JAX_FINE_TUNING_DIR, else ~/.cache/orca_jax/fine_tuning."""
    return os.environ.get("ORCA_JAX_FINE_TUNING_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "orca_jax", "fine_tuning")


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
        self._context = RunContext(self.store, self._lock, model_config, base_model, config.keep_checkpoints)
        self._jobs: dict[str, FineTuningJob] = {}
        self._plans: dict[str, TrainingPlan] = {}  # prepared datasets of queued jobs
        self._served: dict[str, LoRARequest] = {}  # fine_tuned_model -> its adapter, for the server
        self._run: JobRun | None = None
        self._wakeup: Callable[[], None] = lambda: None
        self._preparer = concurrent.futures.ThreadPoolExecutor(1, "orca-finetune-data")
        self._stopping = threading.Event()  # set by suspend(): a dataset being checked stops
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
        self._check_limits(hyperparameters)
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

    def _check_limits(self, hp: TrainingHyperparameters) -> None:
        """ValueError naming the hyperparameter, the server's limit and its flag, for a job larger than
        this server allows (FineTuningConfig)."""
        config = self.config
        for name, limit, flag in (("n_epochs", config.max_epochs, "max-epochs"),
                                  ("batch_size", config.max_batch_size, "max-batch-size"),
                                  ("micro_batch_tokens", config.max_micro_batch_tokens, "max-micro-batch-tokens")):
            if getattr(hp, name) is not None and getattr(hp, name) > limit:
                raise ValueError(f"hyperparameters.{name} must be at most {limit} on this server "
                                 f"(--fine-tuning-{flag}), got {getattr(hp, name)}")

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
            run.park()
            self.parks += 1
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
                tokens, done = run.iterate()
                if done:  # its finish (the peft directory, the adapter served) is part of the iteration
                    self._finish(run)
                self.policy.record(time.perf_counter() - start, tokens, deferred, beside)
        except Exception as error:  # a job's failure is the job's, never the server's
            job = run.job if run is not None else None
            log.exception("fine-tuning job %s failed", job.id if job else "?")
            if job is not None:
                self._fail(job, "training_error", f"{type(error).__name__}: {error}")

    def suspend(self) -> None:
        """The engine stops: a dataset being checked stops at its next line or message (the job stays
        unfinished and is checked again at the next start), and the running job's last finished step
        is checkpointed, so it resumes there."""
        self._stopping.set()
        run = self._run
        if run is not None and (run.ready or run.parked is not None) and run.job.step > run.saved_step:
            run.checkpoint()

    # ---- inside ------------------------------------------------------------------------------------
    def _save(self, job: FineTuningJob) -> None:
        self._context.save(job)

    def _set(self, job: FineTuningJob, status: JobStatus, **fields) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(job, name, value)
            job.status = status
        self._save(job)

    def _prepare(self, job: FineTuningJob) -> None:
        """On the data thread: tokenize the dataset and plan the steps; the job is then queued."""
        try:
            examples = read_jsonl(self.store.read_file(job.training_file), self._tokenizer, self._max_len,
                                  max_messages=self.config.max_example_messages,
                                  should_stop=lambda: job.status.finished or self._stopping.is_set())
            hp = job.hyperparameters
            # No micro_batch_tokens: the most the server allows, shrunk to fit when compiled (sizing.py).
            micro_batch_tokens = hp.micro_batch_tokens or min(DEFAULT_MICRO_BATCH_TOKENS,
                                                              self.config.max_micro_batch_tokens)
            plan = TrainingPlan.make(examples, hp.batch_size, hp.n_epochs, hp.seed, micro_batch_tokens, self._max_len)
        except ValidationStopped:  # cancelled, or the engine stops
            return
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
        self._run = JobRun(job, plan, trainer, compiled, self._context)
        self._set(job, JobStatus.RUNNING)
        self.store.add_event(job.id, f"Fine-tuning job started ({'up to ' if hp.micro_batch_tokens is None else ''}"
                                     f"{plan.rows} rows x {plan.length} tokens per iteration)")

    def _loan_prepared(self) -> bool:
        return self._loan is None or self._loan.prepare().done()

    def _become_ready(self, run: JobRun) -> None:
        """Its programs are compiled: check its memory (once), borrow the KV pool's pages (when it
        lends them), then put its state on the device: fresh, from a checkpoint, or as it parked."""
        if not run.memory_checked:
            source = "lent by the KV pool" if self._loan is not None else "held back from the KV pool"
            problem = run.check_memory(self.config.memory_gib, source)
            if problem is not None:
                self._fail(run.job, "insufficient_memory", problem)
                return
        if self._loan is not None and not self._loan.lend():
            run.wait_for_pages()
            return
        run.become_ready()

    def _finish(self, run: JobRun) -> None:
        """Save the peft directory and serve it under the job's fine_tuned_model at once."""
        job = run.job
        path = run.save_adapter()
        self._end_run()
        name = fine_tuned_model_name(job)
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
