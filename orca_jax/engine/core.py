"""The host-side iteration loop: scheduler -> ragged batch -> runner -> scheduler, one iteration a step.

Up to EngineConfig.max_in_flight batches can be in flight (ORCA Algorithm 1, lines 8-10): one per
pipeline stage, or on a single stage two with async scheduling, so the host builds and dispatches
batch k+1 while the device still runs batch k.

Requests come in through input_processor.py (checked, tokenized, made Requests) and go out through
output_processor.py (RequestOutputs); this file owns the scheduler, the runner and what runs between them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Callable, Protocol

import numpy as np

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request, RequestStatus
from orca_jax.core.sched.interface import SchedulerInterface
from orca_jax.core.sched.output import SchedulerOutput
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.engine.dispatcher import Dispatcher
from orca_jax.engine.input_processor import InputProcessor
from orca_jax.engine.output_processor import request_output
from orca_jax.engine.stats import EngineStats
from orca_jax.finetune.kv_loan import KVLoan, pool_arguments
from orca_jax.finetune.tuner import FineTuner
from orca_jax.lora.manager import LoRAManager
from orca_jax.lora.request import LoRARequest
from orca_jax.models.loader import LoadedModel, load_model
from orca_jax.outputs import RequestError, RequestOutput
from orca_jax.sample.batcher import SamplingBatcher, TokenMaskSource
from orca_jax.sampling_params import SamplingParams
from orca_jax.structured.manager import StructuredOutputManager
from orca_jax.structured.matcher import CompiledGrammar, GrammarCompiler
from orca_jax.worker import multihost, xla_setup
from orca_jax.worker.compilation import PrecompileReport, ProgramKey, ProgressFn, executable_cache_for
from orca_jax.worker.input_batch import BucketPolicy, RaggedBatch, build_batch
from orca_jax.worker.model_runner import ModelRunner, StepResult

log = logging.getLogger(__name__)
# Not the request's doing (a 500, not a 400): its input is tokens like any other's; the weights or a
# planted adapter made the logits so.
NON_FINITE_LOGITS = ("the model's logits for this request were not finite (NaN or infinite), so no token could "
                     "be sampled; the request was ended")


@dataclasses.dataclass(slots=True)
class _InFlight:
    output: SchedulerOutput
    batch: RaggedBatch
    # A Future of the packed device array the runner returns (dispatcher.py); None while its sampling
    # waits (below).
    packed: object
    # Constrained rows whose masks wait for the previous batch's tokens: a Future of the forward pass's
    # logits on the device (None: nothing dispatched yet, with several processes), and the rows to fill.
    logits: object = None
    mask_rows: list[int] = dataclasses.field(default_factory=list)


# (kv, max_model_len, max_in_flight) -> the scheduler an engine drives; Scheduler's own signature after
# its config, so functools.partial(Scheduler, scheduler_config) is one.
SchedulerFactory = Callable[[KVCacheManager, int, int], SchedulerInterface]


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchTiming:
    """Host seconds spent on one batch before it left for the device."""

    schedule_s: float  # schedule() calls since the last dispatch (empty ones included)
    build_s: float  # build_batch
    # runner.execute's submission (dispatcher.py; inline: the launches themselves, asynchronous, but
    # they may block when the device queue is full)
    dispatch_s: float


class EngineObserver(Protocol):
    """Told about every batch an engine dispatches and every update it applies (for benchmarks)."""

    def on_dispatch(self, batch: RaggedBatch, timing: DispatchTiming) -> None: ...

    def on_update(self, output: SchedulerOutput, seconds: float) -> None: ...


def model_config_for(config: EngineConfig, loaded: LoadedModel) -> ModelConfig:
    """The loaded model's config with the engine's length cap, quantization and KV dtype applied."""
    model_config = dataclasses.replace(loaded.config, kv_cache_dtype=config.kv_cache_dtype,
                                       quantization=config.quantization or loaded.config.quantization,
                                       quantize_lm_head=config.quantize_lm_head)
    if config.max_model_len is not None and config.max_model_len < model_config.max_seq_len:
        model_config = dataclasses.replace(model_config, max_seq_len=config.max_model_len)
    return model_config


class Engine:
    """ORCA's engine: add requests at any time, call step() to run one iteration."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 scheduler_factory: SchedulerFactory | None = None,
                 precompile_progress: ProgressFn | None = None, token_masks: TokenMaskSource | None = None):
        self.config = config
        xla_setup.prepare(config.parallel)  # where jax has not started yet (entry points call it earlier)
        executable_cache = executable_cache_for(config.compilation_cache_dir)  # before anything compiles
        loaded = loaded or load_model(config.model, dtype=config.dtype)
        self.tokenizer = loaded.tokenizer
        self.model_config = model_config_for(config, loaded)
        self.max_model_len = self.model_config.max_seq_len
        self.runner = ModelRunner(self.model_config, loaded.params, config.cache, config.attention,
                                  seed=config.seed, parallel=config.parallel,
                                  max_num_seqs=config.scheduler.max_num_seqs, executable_cache=executable_cache,
                                  lora=config.lora, sampling=config.sampling,
                                  **pool_arguments(config.fine_tuning))
        # Structured outputs' masks as wide as the logits (the vocabulary padded for tensor parallelism);
        # token_masks: more per-step allowed tokens from outside the sampler, applied on device too.
        # Intake: prompts and SamplingParams checked and made Requests (tokenizer and configs only).
        self.inputs = InputProcessor(config, self.model_config, self.tokenizer, self.runner.config.vocab_size)
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.config.vocab_size, token_masks,
                                                  limits=config.grammar_limits)
        self._sampling = SamplingBatcher(self.runner.sampler.num_penalty_slots, self.runner.config.vocab_size,
                                         config.sampling.logit_table_width, config.sampling.max_logprobs,
                                         self.structured)
        self.kv = KVCacheManager(self.runner.num_pages, self.runner.page_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching,
                                 lendable_pages=self.runner.lendable_pages)
        # The runner's launches on a thread of their own (dispatcher.py); inline with several processes.
        self._dispatcher = Dispatcher(config.dispatch_thread and config.parallel.num_processes == 1)
        # LoRA adapters (None: off): registered by name, swapped into the runner's device slots, in
        # order with the dispatches.
        self.lora = None if config.lora is None else LoRAManager(
            config.lora, self.model_config, functools.partial(self._dispatcher.run_later, self.runner.load_lora))
        # Fine-tuning jobs (None: off): run between inference iterations, served through self.lora.
        self.buckets = BucketPolicy(max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                                    max_num_seqs=config.scheduler.max_num_seqs,
                                    max_pages=self.kv.num_pages_for(self.max_model_len))
        # The pool's pages a job borrows (None: nothing to lend, RESERVE or a pool too small).
        self.kv_loan = KVLoan(self.kv, self.runner) if self.runner.lendable_pages else None
        self.fine_tuning = None if config.fine_tuning is None else FineTuner(
            config.fine_tuning, self.runner.stages[0], self.model_config, self.tokenizer, self.lora, config.model,
            self.max_model_len, self.kv_loan)
        scheduler_config = dataclasses.replace(config.scheduler, async_scheduling=config.async_scheduling)
        factory = scheduler_factory or functools.partial(
            Scheduler, scheduler_config, token_target=self.buckets.token_target,
            pipeline_stages=config.parallel.num_stages,
            adapters=None if self.lora is None else self.lora.slots)
        self.scheduler: SchedulerInterface = factory(self.kv, self.max_model_len, config.effective_max_in_flight)
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._observers: list[EngineObserver] = []
        self._schedule_s = 0.0  # schedule() time not yet reported with a dispatch
        self._stats = EngineStats(kv_pages_total=self.kv.num_usable_pages)
        # With several processes only process 0 compiles on its own: its runner tells the others,
        # which are in their worker loop by then (multihost.run_worker).
        if config.precompile and multihost.is_leader():
            self.precompile(precompile_progress)
        log.info("engine ready: %s, %d KV pages of %d tokens for requests (+1 scratch page)", config.model,
                 self.kv.num_usable_pages, self.runner.page_size)

    # ---- compiled programs ----

    def program_keys(self) -> list[ProgramKey]:
        """Every program an iteration can need (runner.program_keys of every bucket)."""
        return self.runner.program_keys(self.buckets.all_buckets())

    def precompile(self, progress: ProgressFn | None = None) -> PrecompileReport:
        """Compile every program in program_keys() now (what EngineConfig.precompile does at start)."""
        start = time.perf_counter()
        self.drain()
        report = self.runner.precompile(self.program_keys(), progress)
        log.info("compiled %d programs in %.1fs (%.1fs compiling, %.1fs first runs)", report.num_programs,
                 time.perf_counter() - start, report.compile_seconds, report.warm_seconds)
        return report

    # ---- requests in and out ----

    def add_request(self, prompt: str | list[int], sampling: SamplingParams, *,
                    request_id: str | None = None, priority: int = 0,
                    deadline: float | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, grammar: CompiledGrammar | None = None) -> str:
        """Queue a request; raises ValueError if it can never run (or its structured_outputs do not
        compile), QueueFullError if the pool is full. grammar: its structured_outputs already compiled
        by grammar_compiler (a server compiles off the engine thread), else they are compiled here.

        deadline and arrival_time are on the scheduler's clock (time.monotonic unless a benchmark's
        scheduler counts iterations); arrival_time None: now. lora_request: the adapter to run with
        (registered now if new; a LoRAError, a ValueError, if it cannot be served).
        """
        request = self.inputs.process(prompt, sampling, request_id, priority=priority, deadline=deadline,
                                      arrival_time=arrival_time, lora_request=lora_request)
        request_id, token_ids = request.request_id, request.prompt_token_ids
        if lora_request is not None:
            request.lora_int_id = self.lora.request_added(request_id, lora_request)
        try:
            self.structured.attach(request, grammar)
            self.scheduler.add_request(request)
        except BaseException:
            if request.lora_int_id:  # refused: its adapter need not stay in host memory for it
                self.lora.request_done(request_id)
            raise
        if sampling.prompt_logprobs is not None:  # once the scheduler took it: no prefill for a refused request
            try:
                self.drain()
                request.prompt_logprobs = self.runner.prompt_logprobs(token_ids, sampling.prompt_logprobs)
            except BaseException:
                self.abort(request_id)
                raise
        self._stats.prompt_tokens_total += len(token_ids)
        return request_id

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of structured outputs' grammars for add_request(grammar=...); thread-safe."""
        return self.structured.compiler

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its KV; nothing more is emitted for it."""
        if self.lora is not None:
            self.lora.request_done(request_id)
        return self.scheduler.abort(request_id)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----

    def add_lora(self, lora_request: LoRARequest, adapter=None) -> None:
        """Register an adapter for later requests (read from its path unless `adapter`, a
        lora.adapter.LoRAAdapter, is given); LoRAError (a ValueError) if it cannot be served."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (EngineConfig.lora, --enable-lora)")
        self.lora.add(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (requests using it finish with it); False if unknown."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def has_work(self) -> bool:
        """Unfinished requests, or a fine-tuning job with an iteration to run."""
        return self.has_unfinished() or (self.fine_tuning is not None and self.fine_tuning.has_work())

    def drain(self) -> None:
        """Wait until the runner has made every call the engine handed it (dispatcher.py): before
        anything reaches the runner another way."""
        self._dispatcher.drain()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the pages forgotten. Requests keep the pages they hold."""
        return self.kv.reset_prefix_cache()

    # ---- seams for benchmarks and baselines ----

    def replace_scheduler(self, factory: SchedulerFactory) -> SchedulerInterface:
        """Swap in another scheduler (same KV pool, runner and buckets); only while idle."""
        if self.has_unfinished():
            raise RuntimeError("replace the scheduler only on an idle engine")
        self.scheduler = factory(self.kv, self.max_model_len, self.config.effective_max_in_flight)
        return self.scheduler

    def add_observer(self, observer: EngineObserver) -> None:
        """Report every later dispatch and update to observer."""
        self._observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        self._observers.remove(observer)

    # ---- one iteration ----

    def step(self) -> list[RequestOutput]:
        """Run one iteration: fill the pipeline, then take the oldest batch's tokens.

        A batch whose constrained rows' masks need a token still on the device (async scheduling)
        dispatches its forward pass now and its sampling once the previous batch's tokens are in and
        its masks filled (_dispatch_waiting); no later batch is planned before that, so the device's
        last samples stay in order.

        While no request runs, a fine-tuning iteration runs instead if Deferred Continuous Batching
        allows (finetune/deferral.py); while requests run, one may run first if the job's inference
        slowdown, or its TPOT SLO, allows. A job that borrowed KV pages gives them back first if a
        request the smaller pool could not admit has waited half the deferral bound (finetune/kv_loan.py).
        """
        lent = self.kv_loan is not None and self.kv_loan.lent
        if self.fine_tuning is not None and (lent or self.fine_tuning.has_work()):
            self.drain()  # the job (or the pages it gives back) reaches the runner's stage itself
        if lent:
            refused = self.scheduler.oldest_refused_arrival
            if refused is not None and time.monotonic() - refused >= self.config.fine_tuning.deferral_bound_s / 2:
                self.fine_tuning.yield_memory()
        if self.fine_tuning is not None and self.fine_tuning.has_work():
            if not self._in_flight and not self.scheduler.num_running:
                if self.fine_tuning.maybe_run(self.scheduler.oldest_waiting_arrival, time.monotonic()):
                    return []
            else:  # requests run: an iteration before this one's inference, within the slowdown or the TPOT SLO
                self.fine_tuning.maybe_run_beside(time.monotonic(), lambda: self.scheduler.requests)
        start = phase_start = time.perf_counter()
        dropped: list[RequestOutput] = []
        while self.scheduler.can_schedule and not (self._in_flight and self._in_flight[-1].packed is None):
            output = self.scheduler.schedule()
            scheduled_at = time.perf_counter()
            self._schedule_s += scheduled_at - phase_start
            dropped += [self._output_for(request, 0) for request in output.dropped]
            if self.lora is not None:  # adapters the plan placed in new slots, written before its dispatch
                self.lora.upload_loads()
            if not output.scheduled:
                break
            batch = build_batch(output, self.buckets, self._sampling)
            built_at = time.perf_counter()
            self._in_flight.append(self._dispatch(output, batch))
            phase_start = time.perf_counter()
            timing = DispatchTiming(self._schedule_s, built_at - scheduled_at, phase_start - built_at)
            self._schedule_s = 0.0
            for observer in self._observers:
                observer.on_dispatch(batch, timing)
        if not self._in_flight:
            return dropped
        in_flight = len(self._in_flight)
        flight = self._in_flight.popleft()
        if flight.packed is None:  # its sampling waits for a batch planned before it, which returned first
            raise RuntimeError("the oldest batch in flight was never sampled")
        wait_start = time.perf_counter()
        result = self.runner.fetch(flight.packed.result(), flight.batch)
        wait_end = time.perf_counter()
        outputs = self._process(flight, result)
        self._dispatch_waiting()
        end = time.perf_counter()
        self._record(flight.output, end - start, wait_end - wait_start)
        self._stats.peak_in_flight = max(self._stats.peak_in_flight, in_flight)
        self._stats.in_flight_total += in_flight
        return dropped + outputs

    def _dispatch(self, output: SchedulerOutput, batch: RaggedBatch) -> _InFlight:
        rows = self.structured.rows(output.scheduled)
        if rows and not self.structured.ready(output.scheduled, rows):
            # Single process: the forward pass runs while the previous batch's tokens come back.
            logits = self._dispatcher.submit(self.runner.forward, batch) if self.runner.can_forward_alone else None
            self._stats.structured_deferred_batches += 1
            return _InFlight(output, batch, None, logits, rows)
        if rows:
            self.structured.fill(batch.sampling.allowed_mask, output.scheduled, rows)
        return _InFlight(output, batch, self._dispatcher.submit(self.runner.execute, batch))

    def _dispatch_waiting(self) -> None:
        """Fill the masks of the batch whose sampling waits, once they can be, and dispatch it."""
        flight = self._in_flight[-1] if self._in_flight else None
        if flight is None or flight.packed is not None \
                or not self.structured.ready(flight.output.scheduled, flight.mask_rows):
            return
        self.structured.fill(flight.batch.sampling.allowed_mask, flight.output.scheduled, flight.mask_rows)
        if flight.logits is None:
            flight.packed = self._dispatcher.submit(self.runner.execute, flight.batch)
        else:  # its forward was submitted earlier, so it has run by the time this does
            flight.packed = self._dispatcher.submit(
                lambda logits, batch: self.runner.sample(logits.result(), batch), flight.logits, flight.batch)
        flight.logits = None

    def _process(self, flight: _InFlight, result: StepResult) -> list[RequestOutput]:
        scheduled = flight.output.scheduled
        errored = self._end_non_finite(scheduled, result)
        logprobs = None  # none asked for (most batches): update() skips them
        if any(s.sampling.logprobs is not None for s in scheduled):
            logprobs = [None if (n := s.sampling.logprobs) is None else
                        (float(result.logprobs[i]),
                         dict(zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist())))
                        for i, s in enumerate(scheduled)]
        update_start = time.perf_counter()
        finished_now = set(self.scheduler.update(flight.output, result.token_ids.tolist(), logprobs))
        seconds = time.perf_counter() - update_start
        for observer in self._observers:
            observer.on_update(flight.output, seconds)
        outputs = []
        for item in scheduled:
            request = item.request
            status = request.status
            if status.finished:
                self._sampling.release(request)  # its penalty slot, if it had one
                if status is RequestStatus.FINISHED_ABORTED:
                    continue  # aborted by its caller while in flight; one the engine ends is answered
                if request in errored:
                    outputs.append(self._output_for(request, 0))
                    continue
            num_new = len(request.output_token_ids) - item.step
            # Nothing new: a prompt chunk short of the prompt's end, or (async scheduling) a row
            # planned before an earlier batch finished the request; its token is dropped.
            if num_new <= 0 and request not in finished_now:
                continue
            outputs.append(self._output_for(request, num_new))
        return outputs

    def _end_non_finite(self, scheduled, result: StepResult) -> set[Request]:
        """Finish with an error the requests whose logits were not finite (NaN or +inf somewhere, or
        all -inf: the sampled token's logprob is then NaN), rather than stream a token drawn from them."""
        errored = set()
        for i in np.flatnonzero(np.isnan(result.logprobs)):
            request = scheduled[i].request
            if not request.status.finished:
                request.error = RequestError(NON_FINITE_LOGITS, caused_by_request=False)
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ERROR)
                errored.add(request)
                log.error("request %s: %s", request.request_id, NON_FINITE_LOGITS)
        return errored

    def _output_for(self, request: Request, num_new: int) -> RequestOutput:
        # Stop conditions were applied in scheduler.update(); here the text is only collected.
        if request.status.finished:
            if self.lora is not None:
                self.lora.request_done(request.request_id)
            met = request.deadline_met
            if met is not None:
                self._stats.deadline_hits += met
                self._stats.deadline_misses += not met
        self._stats.generated_tokens_total += num_new
        return request_output(request, num_new)

    def _record(self, output: SchedulerOutput, seconds: float, wait_seconds: float) -> None:
        stats = self._stats
        stats.iterations += 1
        stats.last_batch_size = output.num_requests
        stats.last_num_tokens = output.num_tokens
        stats.last_iteration_seconds = seconds
        stats.batch_size_total += output.num_requests
        stats.scheduled_tokens_total += output.num_tokens
        stats.host_seconds_total += seconds - wait_seconds
        stats.device_wait_seconds_total += wait_seconds

    def stats(self) -> EngineStats:
        """A snapshot of the counters, with the pool's current state filled in."""
        stats = dataclasses.replace(self._stats)
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_pages_used = self.kv.num_used_pages
        stats.kv_pages_reserved = self.kv.num_reserved_pages
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.kv_pages_evictable = self.kv.num_evictable_pages
        stats.prefix_cache_queries = self.kv.num_prefix_cache_queries
        stats.prefix_cache_hits = self.kv.num_prefix_cache_hits
        stats.num_compiled_programs = self.runner.compilation.num_compiled_programs
        stats.structured_mask_seconds_total = self.structured.mask_seconds_total
        stats.structured_masked_batches = self.structured.num_masked_batches
        stats.structured_masked_rows = self.structured.num_masked_rows
        if self.fine_tuning is not None:
            counters = self.fine_tuning.policy.stats
            stats.fine_tuning_iterations = counters.iterations
            stats.fine_tuning_seconds_total = counters.seconds
            stats.fine_tuning_tokens_total = counters.tokens
            stats.inference_deferrals_total = counters.deferrals
            stats.inference_deferral_seconds_total = counters.deferral_seconds
            stats.fine_tuning_parks_total = self.fine_tuning.parks
        if self.kv_loan is not None:
            stats.kv_pages_lent = self.kv_loan.num_pages if self.kv_loan.lent else 0
            stats.kv_loans_total = self.kv_loan.stats.loans
            stats.kv_loan_seconds_total = self.kv_loan.stats.seconds
        return stats
