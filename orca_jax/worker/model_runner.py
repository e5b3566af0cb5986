"""Owns the params and the per-layer KV pages on device, by pipeline stage; dispatches iterations.

An iteration is programs dispatched back to back: per pipeline stage (stage.py; one stage on all
devices when unpipelined) a stage-in that copies the batch's packed inputs into a buffer that stays
put, then the ragged forward pass reading it, with the K/V writes into the (donated) per-layer pages;
then sampling on the last stage (sample/sampler.py; its searches and random draws are slow to compile, so
it stays out of the forward programs). Logits stay on device; only a small packed i32[S, 2 + 2K]
array of token ids and logprobs reaches the host. Which programs exist and how they are compiled is the compilation
manager's (compilation.py); the runner tells it how to lower each key.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Iterable

import jax
import numpy as np

from orca_jax.config import AttentionBackend, CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SamplingConfig
from orca_jax.lora.adapter import LoRAAdapter
from orca_jax.models import decoder
from orca_jax.models.attention import LayerKV
from orca_jax.outputs import PromptLogprobs
from orca_jax.sample.ops.penalties import tables_bytes
from orca_jax.sample.mode import SampleMode
from orca_jax.sample.sampler import PenaltyFillKey, SampleKey, Sampler
from orca_jax.sharding import tensor_plan
from orca_jax.sharding.mesh import TENSOR, check_parallel_fits, make_stage_meshes, stage_layer_ranges
from orca_jax.worker import multihost
from orca_jax.worker.compilation import (Bucket, CompilationManager, ForwardKey, LoRAUpdateKey, PrecompileReport,
                                         ProgramKey, ProgramSource, ProgressFn, PromptLogprobsKey, StageInKey)
from orca_jax.worker.precompile_progress import PrecompilePhase, PrecompileProgress
from orca_jax.worker.executable_cache import ExecutableCache
from orca_jax.worker.forward_kernels import choose_kernels, shard_layer_kernels, shard_over_heads
from orca_jax.worker.input_batch import RaggedBatch, empty_batch, pack_forward_inputs
from orca_jax.worker.kv_pool import num_pages_for, pages_for_budget
from orca_jax.worker.prompt_logprobs import PromptLogprobsProgram
from orca_jax.worker.stage import Handoff, Stage


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """Host view of one iteration's sampled tokens (rows past num_real_seqs dropped)."""

    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray  # f32[S]
    top_ids: np.ndarray  # i32[S, K]
    top_logprobs: np.ndarray  # f32[S, K]

    @classmethod
    def unpack(cls, packed: np.ndarray, num_seqs: int, k: int) -> "StepResult":
        packed = packed[:num_seqs]
        return cls(token_ids=packed[:, 0], logprobs=packed[:, 1].view(np.float32),
                   top_ids=packed[:, 2:2 + k], top_logprobs=packed[:, 2 + k:].view(np.float32))


# The sampling modes a decode forward may run itself (ForwardKey.sampled); the searches stay apart.
SAMPLED_MODES = (SampleMode.GREEDY, SampleMode.SAMPLE)


class ModelRunner:
    """Params + per-layer KV on device, by pipeline stage; `execute` dispatches a step, `fetch` waits
    for its tokens."""

    def __init__(self, config: ModelConfig, params, cache_config: CacheConfig,
                 backend: AttentionBackend = AttentionBackend.AUTO, seed: int = 0,
                 parallel: ParallelConfig = ParallelConfig(), devices: list[jax.Device] | None = None,
                 max_num_seqs: int = 256, executable_cache: ExecutableCache | None = None,
                 lora: LoRAConfig | None = None, sampling: SamplingConfig = SamplingConfig(),
                 reserve_bytes: int = 0, lendable_bytes: int = 0):
        """`reserve_bytes`: device memory per device kept out of a pool sized from free memory;
        `lendable_bytes`: how much of the pool a fine-tuning job may borrow (finetune/kv_loan.py)."""
        check_parallel_fits(parallel, config)
        # Vocabulary padded and KV heads replicated to fit the tensor size; from here on `config` is
        # the device shapes (the logits width, the KV pages), the plan keeps the model's own.
        self.tensor_plan = tensor_plan.plan_for(config, parallel.tensor_parallel)
        self.config = config = self.tensor_plan.device
        self.max_num_seqs = max_num_seqs  # the most sequences one batch holds: the width of next_tokens
        self.lora_config = lora  # None: no adapter table, and no forward program has the adapter term
        meshes = make_stage_meshes(parallel, devices)
        self.device = meshes[0].devices.flat[0]
        # This process's first device: only those answer memory_stats (several processes).
        self.local_device = next(d for mesh in meshes for d in mesh.devices.flat if d.process_index == jax.process_index())
        kernels = choose_kernels(backend, self.device.platform)
        self.stages = [
            Stage(i, len(meshes), layers, mesh, self.tensor_plan,
                  decoder.Decoder(config, shard_over_heads(kernels.attention, mesh),
                                  real_vocab_size=self.tensor_plan.vocab_size, kv_repeat=self.tensor_plan.kv_repeat,
                                  kernels=shard_layer_kernels(kernels.layer, mesh),
                                  decode_attention_fn=None if kernels.decode_attention is None
                                  else shard_over_heads(kernels.decode_attention, mesh)),
                  lora)
            for i, (layers, mesh) in enumerate(zip(stage_layer_ranges(config.num_layers, len(meshes)), meshes))]
        # Logits and samples written in place, at one address each step: one stage only (sampler.py).
        self.stable_buffers = len(self.stages) == 1
        # Decode batches (one token per request) run forwards of their own (ForwardKey.decode).
        self.decode_programs = self.stages[0].model.has_decode_attention
        # ... which with one stage also sample plain batches themselves (ForwardKey.sampled, stage.py).
        self.sampled_decode = self.decode_programs and self.stable_buffers and sampling.fuse_decode_sampling
        self.page_size = cache_config.page_size
        # Every stage keeps the same pages (one page table): size the pool by the fullest device, from
        # the weights' shapes, before any is placed (their bytes are still to come out of free memory).
        # The last stage also holds the sampler's token-count tables (a penalty slot per batch row).
        # and (one stage) its logits buffer (f32[max_num_seqs, V], replicated).
        per_device = max(stage.params_bytes // stage.mesh.size
                         + (tables_bytes(max_num_seqs, config.vocab_size)
                            + (4 * max_num_seqs * config.vocab_size if self.stable_buffers else 0)
                            if stage.last else 0)
                         for stage in self.stages)
        self.num_pages = num_pages_for(config, cache_config, per_device, self.local_device,
                                       sum(stage.mesh.size for stage in self.stages),
                                       max_num_seqs=max_num_seqs, max_model_len=config.max_seq_len,
                                       reserve_bytes=reserve_bytes)
        if jax.process_count() > 1:  # the pool is in every program's shapes: the processes must agree
            from jax.experimental import multihost_utils
            self.num_pages = int(np.min(multihost_utils.process_allgather(np.int32(self.num_pages))))
        # The pool's top pages a fine-tuning job may borrow: forwards over the smaller pool are their
        # own programs (ForwardKey.lent), compiled when a job first needs them. What stays still holds
        # one request of the longest length, so inference always makes progress.
        self.full_pages = self.num_pages
        kept = 1 + -(-config.max_seq_len // self.page_size)
        # lendable_bytes is per device: a page frees its layers' share of its tokens' K/V on each device
        # (KV heads split over the tensor axis, replicated ones included). The fullest stage's: a job
        # trains on one stage (config.py refuses fine-tuning with several), so this is that stage's.
        per_device = max(stage.config.kv_bytes_per_token * len(stage.layers)
                         // (config.num_layers * stage.mesh.shape[TENSOR]) for stage in self.stages)
        self.lendable_pages = max(0, min(pages_for_budget(per_device, self.page_size, lendable_bytes),
                                         self.num_pages - kept))
        self._params_ready = self._start_making_params(params, seed)
        for stage in self.stages:
            stage.params_ready = self._params_ready
            stage.allocate_kv(self.num_pages, self.page_size)
        first, last = self.stages[0], self.stages[-1]
        self.sampler = Sampler(last.replicated, config.vocab_size, max_num_seqs, sampling, self.stable_buffers)
        # SamplingConfig.enable_prompt_logprobs: a forward over whole prompts (None: off, no programs).
        self._prompt_logprobs = PromptLogprobsProgram(first, sampling.max_logprobs, config.max_seq_len) \
            if sampling.enable_prompt_logprobs else None
        # Activations [T, H] from each stage to the next; sampled tokens back to the first stage,
        # and the packed result too where process 0 (which fetches it) has no device of the last.
        self._to_next = [Handoff(a.mesh, b.mesh) for a, b in zip(self.stages, self.stages[1:])]
        self._to_first = Handoff(last.mesh, first.mesh)
        self._result_to_first = all(d.process_index != 0 for d in last.mesh.devices.flat)
        # The last sampled token of every row, on the first stage, for a batch dispatched before they
        # reach the host (see RaggedBatch.token_sources). Nothing sampled yet: zeros.
        # With one stage this is the sampler's own buffer (sampler.py), rewritten in place each step.
        self._next_tokens = self.sampler.last_samples if len(self.stages) == 1 else \
            jax.device_put(np.zeros(max_num_seqs, np.int32), first.replicated)
        # A batch without token sources reads no samples: giving it this constant instead keeps stage
        # 0 of batch k+1 from waiting for batch k's sampling, i.e. for the whole pipeline to drain.
        # Its own buffer: the samples' is donated to every sampling.
        self._no_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), first.replicated)
        # The last stage's logits buffers f32[max_num_seqs, V] not in use: each forward takes one and
        # gives it back once its sampling is dispatched, so in steady state every forward writes the
        # same buffer (stage.py says why the address matters). One is made here, ahead of serving.
        self._free_logits: list[jax.Array] = [self._new_logits_buffer()] if self.stable_buffers else []
        # Several controller processes: process 0 sends each call to the others (see multihost.py),
        # and an executable of several processes is theirs together (not cached on disk).
        self.mirror = multihost.Mirror(parallel) if jax.process_count() > 1 else None
        self.compilation = CompilationManager(
            self._program_source, self._program_identity(backend), self.device.platform,
            executable_cache if self.mirror is None else None)

    def _start_making_params(self, params, seed: int) -> concurrent.futures.Future:
        """Make the weights (drawn, or placed from `params`) on a thread of their own, so a start
        compiles the programs meanwhile: those need only the weights' shapes. Several processes make
        them in line instead, every process dispatching the same programs in the same order."""
        start = time.perf_counter()

        def make() -> float:
            host = None if params is None else self.tensor_plan.adapt_params(decoder.unstack_layers(params))
            for stage in self.stages:
                stage.make_params(host, seed)
            jax.block_until_ready([stage.params for stage in self.stages])
            return time.perf_counter() - start

        if jax.process_count() > 1:
            ready = concurrent.futures.Future()
            ready.set_result(make())
            return ready
        maker = concurrent.futures.ThreadPoolExecutor(1, "orca-params")
        ready = maker.submit(make)
        maker.shutdown(wait=False)  # its one thread ends once the weights are made
        return ready

    def _program_identity(self, backend: AttentionBackend) -> tuple:
        """What every program of this runner depends on beyond its own key and input arrays."""
        return (repr(self.config), backend.value, self.device.platform, self.tensor_plan.vocab_size,
                self.max_num_seqs, repr(self.lora_config), [(dict(s.mesh.shape), [d.id for d in s.mesh.devices.flat], s.layers)
                                    for s in self.stages],
                # The flag adds programs of its own; the others do not depend on it.
                repr(dataclasses.replace(self.sampler.config, enable_prompt_logprobs=False)))

    @property
    def params_seconds(self) -> float:
        """Seconds from the runner's start to every weight on device (waits for them)."""
        return self._params_ready.result()

    @property
    def params_bytes(self) -> int:
        return sum(stage.params_bytes for stage in self.stages)

    @property
    def num_devices(self) -> int:
        return sum(stage.mesh.size for stage in self.stages)

    @property
    def pool_lent(self) -> bool:
        """Whether a fine-tuning job borrows the pool's top pages now."""
        return self.num_pages < self.full_pages

    def resize_pool(self, lent: bool) -> None:
        """Give the lendable pages up (their memory is freed) or take them back (zeroed), on every
        stage; waits for the batches in flight. The programs for the new size must be compiled
        (prepare_lending) and, for `lent`, nothing above the cut held (KVCacheManager.lend)."""
        num_pages = self.full_pages - self.lendable_pages if lent else self.full_pages
        if num_pages != self.num_pages:
            for stage in self.stages:
                stage.resize_kv(num_pages)
            self.num_pages = num_pages

    @property
    def kv(self) -> tuple[LayerKV, ...]:
        """Every layer's pages, in layer order (each stage's on its own devices)."""
        return tuple(layer for stage in self.stages for layer in stage.kv)

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the whole KV pool, all layers and shards."""
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self.kv))

    # ---- programs ----

    def program_keys(self, buckets: Iterable[Bucket]) -> list[ProgramKey]:
        """Every program an iteration over these buckets can need: per bucket a stage-in and a forward
        per stage (with LoRA, a second forward with the adapter term, and one slot update per stage),
        and the sampling family per sequence width (sample/sampler.py); with prompt logprobs, their program per
        length bucket (prompt_logprobs.py)."""
        buckets = list(buckets)
        keys: list[ProgramKey] = [cls(bucket, stage.index) for bucket in buckets
                                  for cls in (StageInKey, ForwardKey) for stage in self.stages]
        if self.lora_config is not None:
            keys += [ForwardKey(bucket, stage.index, True) for bucket in buckets for stage in self.stages]
            keys += [LoRAUpdateKey(stage.index) for stage in self.stages]
        if self.decode_programs:  # the buckets a batch of one token per request (at most max_num_seqs) lands in
            ceiling = min((b.tokens for b in buckets if b.tokens >= self.max_num_seqs),
                          default=max((b.tokens for b in buckets), default=0))
            keys += [dataclasses.replace(key, decode=True) for key in keys
                     if isinstance(key, ForwardKey) and key.bucket.tokens <= ceiling]
        if self.sampled_decode:
            keys += [dataclasses.replace(key, sampled=int(mode)) for key in keys
                     if isinstance(key, ForwardKey) and key.decode and not key.lora and key.bucket.seqs <= self.max_num_seqs
                     for mode in SAMPLED_MODES]
        if self._prompt_logprobs is not None:
            keys += [PromptLogprobsKey(length) for length in self._prompt_logprobs.lengths]
        return keys + self.sampler.program_keys(b.seqs for b in buckets)

    def prepare_lending(self, threads: int | None = None) -> float:
        """Compile what lending needs: the pages' resize copies, and the smaller pool's twin of every
        forward compiled so far (all of them after a precompile; with precompile off, later ones
        compile on demand as usual). Blocking, so call it off the engine thread; returns its seconds."""
        if self.lendable_pages == 0:
            raise RuntimeError("this runner's pool has no lendable pages")
        start = time.perf_counter()
        lent = self.full_pages - self.lendable_pages
        for stage in self.stages:
            stage.compile_resize(lent)
        keys = sorted(dataclasses.replace(key, lent=True) for key in self.compilation.compiled_keys
                      if isinstance(key, ForwardKey) and not key.lent)
        self.compilation.precompile(keys, None, threads)
        return time.perf_counter() - start

    def _program_source(self, key: ProgramKey) -> ProgramSource:
        if isinstance(key, (SampleKey, PenaltyFillKey)):  # sampling runs on the last stage's mesh
            return ProgramSource(functools.partial(self.sampler.lower, key),
                                 list(self.stages[-1].mesh.devices.flat), ())
        if isinstance(key, PromptLogprobsKey):
            program = self._prompt_logprobs
            return ProgramSource(functools.partial(program.lower, key.length), list(program.stage.mesh.devices.flat),
                                 program.input_specs)
        stage = self.stages[key.stage]
        if isinstance(key, StageInKey):  # its only inputs are the packed vectors its key sizes
            return ProgramSource(functools.partial(stage.lower_stage_in, key.bucket),
                                 list(stage.mesh.devices.flat), ())
        if isinstance(key, LoRAUpdateKey):  # its inputs are the table's shapes, in the identity
            return ProgramSource(stage.lora.lower_update, list(stage.mesh.devices.flat), ())
        num_pages = self.full_pages - self.lendable_pages if key.lent else self.full_pages
        return ProgramSource(functools.partial(stage.lower, key.bucket, self.max_num_seqs, key.lora, num_pages,
                                               self.stable_buffers, key.decode, key.sampled),
                             list(stage.mesh.devices.flat), stage.input_specs(key.lora, num_pages))

    def precompile(self, keys: Iterable[ProgramKey], progress: ProgressFn | None = None,
                   threads: int | None = None, warm: bool = True) -> PrecompileReport:
        """Compile every program in `keys` ahead of time; then run each new bucket once on padding."""
        keys = list(keys)
        if self.mirror is not None:
            self.mirror.precompile(keys, warm)
        todo, compile_seconds, seconds_by_key = self.compilation.precompile(keys, progress, threads)
        start = time.perf_counter()
        if warm:
            self._first_runs(todo, progress)
        return PrecompileReport(len(todo), compile_seconds, time.perf_counter() - start, seconds_by_key)

    def _first_runs(self, compiled: list[ProgramKey], progress: ProgressFn | None) -> None:
        """Run each newly compiled forward once on padding: dispatched back to back, waited for once,
        so the device runs one while the host loads the next (on a CPU the host's part, loading the
        module, is most of it)."""
        start = time.perf_counter()
        variants = sorted({(key.bucket, key.lora, key.decode) for key in compiled
                           if isinstance(key, ForwardKey) and key.lent == self.pool_lent})

        def report(started: int) -> None:  # no estimate: a run's dispatch returns before its work is done
            if progress is not None and variants:
                progress(PrecompileProgress(PrecompilePhase.FIRST_RUNS, started, len(variants),
                                            time.perf_counter() - start))

        outs = []
        for started, (bucket, lora, decode) in enumerate(variants):
            report(started)
            outs.append(self._forward(empty_batch(*bucket, lora=lora), decode))
            self.release_logits(outs[-1])  # the next warm run writes the same buffer
        # Decode forwards that sample run once too, on a samples buffer of their own (the engine's last
        # samples may still be read by a batch in flight): their first run records their CUDA graph.
        scratch = self.sampler.constant(np.zeros(self.max_num_seqs, np.int32))
        for key in sorted(key for key in compiled if isinstance(key, ForwardKey) and key.sampled >= 0
                          and key.lent == self.pool_lent):
            batch = empty_batch(*key.bucket)
            batch = dataclasses.replace(batch, sampling=dataclasses.replace(batch.sampling, sample_mode=SampleMode(key.sampled)))
            packed, scratch = self.stages[0].run_sampled(key.bucket, self.compilation.executable(StageInKey(key.bucket, 0)),
                                                         self.compilation.executable(key), pack_forward_inputs(batch), scratch)
            outs.append(packed)
        report(len(variants))
        jax.block_until_ready([out for out in outs if not out.is_deleted()] + [stage.kv for stage in self.stages])

    # ---- one iteration ----

    @property
    def can_forward_alone(self) -> bool:
        """Whether forward() may run apart from sample(): in one process (several mirror execute)."""
        return self.mirror is None

    def forward(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch the forward pass through every stage (asynchronous); returns a logits buffer
        f32[max_num_seqs, V] on the last stage's devices whose first S rows are the batch's (the
        caller owns it until it passes it to sample()); with several stages f32[S, V]. Single process
        only (execute is what other processes mirror)."""
        if self.mirror is not None:
            raise RuntimeError("with several processes call execute, which the others mirror")
        return self._forward(batch)

    def _to_first_stage(self, x: jax.Array) -> jax.Array:
        """`x` (on the last stage) on the first stage: itself with one stage (same buffer, same address)."""
        return x if len(self.stages) == 1 else self._to_first(x)

    def release_logits(self, logits: jax.Array) -> None:
        """A forward's logits buffer, read by everything dispatched so far, for the next forward (the
        device runs that after those reads); at most two are kept (a deferred sampling holds one)."""
        if self.stable_buffers and logits.shape[0] == self.max_num_seqs and len(self._free_logits) < 2 \
                and not any(logits is free for free in self._free_logits):
            self._free_logits.append(logits)

    def _new_logits_buffer(self) -> jax.Array:
        return self.sampler.constant(np.zeros((self.max_num_seqs, self.config.vocab_size), np.float32))

    def _forward(self, batch: RaggedBatch, decode: bool | None = None) -> jax.Array:
        """`decode`: run the bucket's decode programs (None: when the batch is a decode batch and this
        runner has them)."""
        bucket = batch.bucket
        if decode is None:
            decode = self.decode_programs and batch.is_decode
        if batch.has_lora and self.lora_config is None:
            raise ValueError("a batch with LoRA adapter slots, but this runner has no adapter table")
        packed = pack_forward_inputs(batch)  # i32: one host-to-device copy per stage, not nine
        inputs = self._no_tokens if batch.token_sources is None else self._next_tokens
        executable = self.compilation.executable
        for stage in self.stages:  # activations [T, H] from stage to stage; logits f32[S, V] last
            if stage.index > 0:
                inputs = self._to_next[stage.index - 1](inputs)
            logits = (self._free_logits.pop() if self._free_logits else self._new_logits_buffer()) \
                if self.stable_buffers and stage.last and bucket.seqs <= self.max_num_seqs else None
            inputs = stage.run(bucket, executable(StageInKey(bucket, stage.index)),
                               executable(ForwardKey(bucket, stage.index, batch.has_lora, self.pool_lent, decode)), packed, inputs,
                               batch.has_lora, logits)
        return inputs

    def load_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` (None: zeros) into adapter slot `slot` (1-based, as a batch's lora_slots
        name it) on every stage; asynchronous, ordered after every batch already dispatched."""
        if self.lora_config is None:
            raise RuntimeError("this runner has no LoRA adapter table (EngineConfig.lora is None)")
        for stage in self.stages:
            stage.lora.load(self.compilation.executable(LoRAUpdateKey(stage.index)), slot - 1, adapter)

    def sample(self, logits: jax.Array, batch: RaggedBatch) -> jax.Array:
        """Dispatch sampling of a forward's logits (its buffer f32[max_num_seqs, V], which goes back
        to the runner: the caller must not read it afterwards); returns the packed i32[S, 2 + 2K]
        device array."""
        packed, next_tokens = self.sampler.run(logits, batch.sampling, self.compilation.executable)
        self.release_logits(logits)
        # Sampled on the last stage; a later batch's token sources are read on the first.
        self._next_tokens = self._to_first_stage(next_tokens)
        return self._to_first(packed) if self._result_to_first else packed

    def execute(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch one iteration (asynchronous); returns the packed device result."""
        if self.mirror is not None:
            self.mirror.execute(batch)
        if self.samples_in_forward(batch):
            return self._execute_sampled(batch)
        return self.sample(self._forward(batch), batch)

    def samples_in_forward(self, batch: RaggedBatch) -> bool:
        """Whether `batch` runs a decode forward that samples its logits itself (ForwardKey.sampled):
        one stage, a decode batch without adapters, plain sampling without top logprobs."""
        sampling = batch.sampling
        return (self.sampled_decode and batch.is_decode and not batch.has_lora
                and batch.bucket.seqs <= self.max_num_seqs and not sampling.logits_processed
                and sampling.num_top_logprobs == 0 and sampling.sample_mode in SAMPLED_MODES)

    def _execute_sampled(self, batch: RaggedBatch) -> jax.Array:
        bucket, stage, executable = batch.bucket, self.stages[0], self.compilation.executable
        key = ForwardKey(bucket, 0, False, self.pool_lent, True, int(batch.sampling.sample_mode))
        # The previous samples: read where the batch feeds tokens back, then overwritten (donated).
        packed, samples = stage.run_sampled(bucket, executable(StageInKey(bucket, 0)), executable(key),
                                            pack_forward_inputs(batch), self.sampler.last_samples)
        self.sampler.last_samples = self._next_tokens = samples
        return packed

    def prompt_logprobs(self, token_ids: list[int], num_top: int) -> PromptLogprobs:
        """The logprobs of a prompt's tokens with the top `num_top` at each position (prompt_logprobs.py):
        one forward over the whole prompt, waited for (behind the batches already on the device)."""
        if self._prompt_logprobs is None:
            raise RuntimeError("this runner computes no prompt logprobs (SamplingConfig.enable_prompt_logprobs)")
        key = PromptLogprobsKey(self._prompt_logprobs.length_for(len(token_ids)))
        return self._prompt_logprobs.run(self.compilation.executable(key), token_ids, num_top)

    def stop_workers(self) -> None:
        """With several processes, end the others' worker loops (call on process 0; else a no-op)."""
        if self.mirror is not None:
            self.mirror.stop()

    @staticmethod
    def fetch(packed: jax.Array, batch: RaggedBatch) -> StepResult:
        """Block until the step's tokens are on the host."""
        # Across processes the result is replicated over devices this process owns only some of.
        host = np.asarray(packed if packed.is_fully_addressable else packed.addressable_data(0))
        return StepResult.unpack(host, batch.num_real_seqs, batch.sampling.num_top_logprobs)

