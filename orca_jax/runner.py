"""Owns the params and the per-layer KV pages on device, and the compiled programs of each bucket.

An iteration is programs dispatched back to back: per (T, S, P) bucket and pipeline stage (pipeline.py;
one stage on all devices when unpipelined) a stage-in that copies the batch's packed inputs into a
buffer that stays put (buckets from STAGE_INPUTS_FROM_TOKENS on), then the ragged forward pass reading
it, with the K/V writes into the (donated) per-layer pages; and sampling on the last stage, one per
(S, K, greedy) (its sorts and random draws are slow to compile, so they stay out of the forward
buckets). The stage-in is its own program because a GPU forward fed a fresh input buffer re-records
its whole CUDA graph: on an H100 (llama-8b, 32 layers, T = 160) host dispatch per iteration went from
4.33 ms to 2.51 ms with it.
Programs are compiled ahead of time by `precompile` (on a thread pool: XLA compiles outside the
GIL) and called as compiled executables, so nothing compiles while serving; a shape that was not
precompiled still runs, compiled on the spot and logged as a warning. Logits stay on device; only a
small packed i32[S, 2 + 2K] array of token ids and logprobs reaches the host.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from orca_jax import multihost
from orca_jax.batch import RaggedBatch, empty_batch, next_power_of_two, pack_forward_inputs
from orca_jax.config import AttentionBackend, CacheConfig, ModelConfig, ParallelConfig
from orca_jax.executable_cache import ExecutableCache, describe_arrays
from orca_jax.kernels import ragged_attention as ragged
from orca_jax.kv_pool import num_pages_for
from orca_jax.kernels.ragged_attention_blocked import ragged_attention_blocked
from orca_jax.models import decoder
from orca_jax.models.attention import LayerKV
from orca_jax.pipeline import Handoff, Stage
from orca_jax.sampling import SamplingArrays, pack, sample
from orca_jax.sharding import rules, tensor_plan
from orca_jax.sharding.mesh import TENSOR, check_parallel_fits, make_stage_meshes, stage_layer_ranges

log = logging.getLogger(__name__)

# Buckets of at least this many tokens copy their inputs into a buffer that stays put before the
# forward (a stage-in program, see pipeline.py); smaller ones pass them to the forward directly. On
# an H100, decode iterations of 1 and 32 sequences (T = 8, 32) took the same time either way, for
# llama-1b and llama-8b; at T = 160 staging cut llama-8b's host dispatch from 4.3 to 2.5 ms.
STAGE_INPUTS_FROM_TOKENS = 64

# Program keys: ("forward", T, S, P, stage), ("stage_in", T, S, P, stage) and ("sample", S, K, all_greedy).
ProgramKey = tuple
# progress(done, total, key, seconds): called as each program finishes compiling.
ProgressFn = Callable[[int, int, ProgramKey, float], None]


def compiler_options_for(platform: str) -> dict | None:
    """XLA options for the engine's programs. On GPU, autotuning skips initializing and checking its
    candidates' buffers (level 1 of 4): a gemm's speed does not depend on the values, and on an H100
    one 8-layer llama-8b forward compiled in 4.5 s instead of 6.0 s (T = 160; 5.4 vs 5.9 s at
    T = 1024) with the same device time. Level 0 (no autotuning) ran 20-45x slower."""
    return {"xla_gpu_autotune_level": 1} if platform == "gpu" else None


def choose_attention(backend: AttentionBackend, platform: str):
    """The ragged attention implementation for a backend choice on a platform."""
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.JNP
    if backend is AttentionBackend.JNP:
        return ragged_attention_blocked
    # Off GPU the kernel can only run in interpret mode (slow, for tests).
    return functools.partial(ragged.ragged_attention, interpret=platform != "gpu")


def shard_over_heads(attention_fn, mesh: Mesh):
    """Attention is independent per head: run it on each tensor shard's own heads and KV pages."""
    if mesh.shape[TENSOR] == 1:
        return attention_fn
    replicated = P()
    return jax.shard_map(
        attention_fn, mesh=mesh,
        in_specs=(rules.HEADS_SPEC, rules.KV_CACHE_SPEC, rules.KV_CACHE_SPEC) + (replicated,) * 4,
        out_specs=rules.HEADS_SPEC, check_vma=False)


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


@dataclasses.dataclass(frozen=True, slots=True)
class PrecompileReport:
    """What `precompile` compiled and how long it took."""

    num_programs: int  # compiled by this call (already compiled ones are skipped)
    compile_seconds: float  # wall time of the (parallel) compilation
    warm_seconds: float  # one run of every new forward program (module load, first-call costs)
    # Each program's own lowering + compiling (or executable-cache load) time, on its worker thread:
    # their sum over compile_seconds is how parallel the compilation was.
    seconds_by_key: dict[ProgramKey, float] = dataclasses.field(default_factory=dict)


class ModelRunner:
    """Params + per-layer KV on device, by pipeline stage; `execute` dispatches a step, `fetch` waits
    for its tokens."""

    def __init__(self, config: ModelConfig, params, cache_config: CacheConfig,
                 backend: AttentionBackend = AttentionBackend.AUTO, seed: int = 0,
                 parallel: ParallelConfig = ParallelConfig(), devices: list[jax.Device] | None = None,
                 max_seqs: int = 256, executable_cache: ExecutableCache | None = None,
                 stage_inputs_from: int = STAGE_INPUTS_FROM_TOKENS):
        check_parallel_fits(parallel, config)
        # Vocabulary padded and KV heads replicated to fit the tensor size; from here on `config` is
        # the device shapes (the logits width, the KV pages), the plan keeps the model's own.
        self.tensor_plan = tensor_plan.plan_for(config, parallel.tensor_parallel)
        config = self.tensor_plan.device
        self.config = config
        self.max_seqs = max_seqs  # the most sequences one batch holds: the width of next_tokens
        self.stage_inputs_from = stage_inputs_from  # buckets of fewer tokens feed their forward directly
        meshes = make_stage_meshes(parallel, devices)
        self.num_devices = sum(mesh.size for mesh in meshes)
        self.device = meshes[0].devices.flat[0]
        attention = choose_attention(backend, self.device.platform)
        ranges = stage_layer_ranges(config.num_layers, len(meshes))
        self.stages = [
            Stage(i, len(meshes), layers, mesh, self.tensor_plan,
                  decoder.Decoder(config, shard_over_heads(attention, mesh),
                                  real_vocab_size=self.tensor_plan.vocab_size))
            for i, (layers, mesh) in enumerate(zip(ranges, meshes))]
        self.params_bytes = sum(stage.params_bytes for stage in self.stages)
        self.page_size = cache_config.page_size
        # Every stage keeps the same pages (one page table): size the pool by the fullest device, from
        # the weights' shapes, before any is placed (their bytes are still to come out of free memory).
        per_device = max(stage.params_bytes // stage.mesh.size for stage in self.stages)
        self.num_pages = num_pages_for(config, cache_config, per_device, self.device, self.num_devices,
                                       max_num_seqs=max_seqs, max_model_len=config.max_seq_len)
        # The weights are made (drawn, or placed from `params`) on a thread of their own, so a start
        # compiles the programs meanwhile: those need only the weights' shapes. Several processes
        # make them in line instead, every process dispatching the same programs in the same order.
        self._params_seconds = None
        make = functools.partial(self._make_params, params, seed, time.perf_counter())
        if jax.process_count() == 1:
            maker = concurrent.futures.ThreadPoolExecutor(1, "orca-params")
            self._params_ready = maker.submit(make)
            maker.shutdown(wait=False)  # its one thread ends once the weights are made
        else:
            self._params_ready = concurrent.futures.Future()
            self._params_ready.set_result(make())
        for stage in self.stages:
            stage.params_ready = self._params_ready
            stage.allocate_kv(self.num_pages, self.page_size)
        first, last = self.stages[0], self.stages[-1]
        self._sample_fn = jax.jit(_sample, static_argnums=(2, 3, 4))
        self._sample_sharding = last.replicated
        # The last sampled token of every row, on the first stage, for a batch dispatched before they
        # reach the host (see RaggedBatch.token_sources). Nothing sampled yet: zeros.
        self._next_tokens = jax.device_put(np.zeros(max_seqs, np.int32), first.replicated)
        # A batch without token sources reads no samples: giving it this constant instead keeps stage
        # 0 of batch k+1 from waiting for batch k's sampling, i.e. for the whole pipeline to drain.
        self._no_tokens = self._next_tokens
        # Activations [T, H] from each stage to the next; sampled tokens back to the first stage,
        # and the packed result too where process 0 (which fetches it) has no device of the last.
        self._to_next = [Handoff(a.mesh, b.mesh) for a, b in zip(self.stages, self.stages[1:])]
        self._to_first = Handoff(last.mesh, first.mesh)
        self._result_to_first = all(d.process_index != 0 for d in last.mesh.devices.flat)
        self._executables: dict[ProgramKey, jax.stages.Compiled] = {}
        self._compile_lock = threading.Lock()
        # Several controller processes: process 0 sends each call to the others (see multihost.py).
        self._mirror = multihost.Mirror() if jax.process_count() > 1 else None
        self.executable_cache = executable_cache if self._mirror is None else None
        # What every program of this runner depends on beyond its own key and input arrays.
        self._identity = (repr(config), backend.value, self.device.platform, self.tensor_plan.vocab_size,
                          compiler_options_for(self.device.platform),
                          max_seqs, [(dict(s.mesh.shape), [d.id for d in s.mesh.devices.flat], s.layers)
                                     for s in self.stages])

    def _make_params(self, params, seed: int, start: float) -> None:
        host = None if params is None else self.tensor_plan.adapt_params(decoder.unstack_layers(params))
        for stage in self.stages:
            stage.make_params(host, seed)
        jax.block_until_ready([stage.params for stage in self.stages])
        self._params_seconds = time.perf_counter() - start

    @property
    def params_seconds(self) -> float:
        """Seconds from the runner's start to every weight on device (waits for them)."""
        self._params_ready.result()
        return self._params_seconds

    # ---- compiled programs ----

    @property
    def compiled_shapes(self) -> frozenset[ProgramKey]:
        """Keys of every compiled program: ("forward" or "stage_in", T, S, P, stage) and ("sample", S, K,
        greedy)."""
        return frozenset(self._executables)

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled so far; executables never recompile (a mismatched call raises)."""
        return len(self._executables)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def kv(self) -> tuple[LayerKV, ...]:
        """Every layer's pages, in layer order (each stage's on its own devices)."""
        return tuple(layer for stage in self.stages for layer in stage.kv)

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the whole KV pool, all layers and shards."""
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self.kv))

    def program_keys(self, keys: Iterable[ProgramKey]) -> list[ProgramKey]:
        """Keys as compiled: a bucket's ("forward", T, S, P) stands for a forward program per stage, and
        a stage-in program per stage when T >= stage_inputs_from."""
        out = []
        for key in keys:
            if key[0] == "forward" and len(key) == 4:
                kinds = ("forward", "stage_in") if self._stages_inputs(key[1]) else ("forward",)
                out += [(kind, *key[1:], stage.index) for kind in kinds for stage in self.stages]
            else:
                out.append(tuple(key))
        return out

    def _stages_inputs(self, tokens: int) -> bool:
        return tokens >= self.stage_inputs_from

    def precompile(self, keys: Iterable[ProgramKey], progress: ProgressFn | None = None,
                   threads: int | None = None, warm: bool = True) -> PrecompileReport:
        """Compile every program in `keys` ahead of time; then run each new bucket once on padding."""
        keys = self.program_keys(keys)
        if self._mirror is not None:
            self._mirror.precompile(keys, warm)
        todo = [key for key in dict.fromkeys(keys) if key not in self._executables]
        start = time.perf_counter()
        # XLA compiles outside the GIL and is CPU-bound: one thread per core this process may use.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = threads or max(1, min(len(todo), cores))
        seconds_by_key = {}

        def timed(key):
            began = time.perf_counter()
            compiled = self._lower_and_compile(key)
            seconds_by_key[key] = time.perf_counter() - began
            return compiled

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(timed, key): key for key in todo}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                self._executables[key] = future.result()
                if progress is not None:
                    progress(done, len(todo), key, time.perf_counter() - start)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if warm:  # dispatched back to back, waited for once: the device runs one while the host loads the next
            jax.block_until_ready([self._forward(empty_batch(t, s, p)) for t, s, p in
                                   sorted({key[1:4] for key in todo if key[0] in ("forward", "stage_in")})])
        return PrecompileReport(len(todo), compile_seconds, time.perf_counter() - start, seconds_by_key)

    def compiled_program(self, key: ProgramKey) -> jax.stages.Compiled:
        """The compiled executable of a program key (compiled now if it is not yet), e.g. to read its
        memory_analysis() or HLO."""
        return self._executable(key)

    def _executable(self, key: ProgramKey) -> jax.stages.Compiled:
        executable = self._executables.get(key)
        if executable is None:
            with self._compile_lock:
                if key not in self._executables:
                    log.warning("compiling %s on demand (not precompiled); %d programs so far",
                                key, len(self._executables) + 1)
                    self._executables[key] = self._lower_and_compile(key)
            executable = self._executables[key]
        return executable

    def _lower_and_compile(self, key: ProgramKey) -> jax.stages.Compiled:
        """From the executable cache where it holds the program, else lowered and compiled (and kept)."""
        if self.executable_cache is None:
            return self._lower_and_compile_now(key)
        if key[0] == "forward":
            stage = self.stages[key[4]]
            inputs = (describe_arrays(stage.param_specs), describe_arrays(stage.kv))
        elif key[0] == "stage_in":  # its only inputs are the packed vectors its key sizes
            stage, inputs = self.stages[key[4]], ()
        else:
            stage, inputs = self.stages[-1], ()  # sampling runs on the last stage's mesh
        devices = list(stage.mesh.devices.flat)
        fingerprint = self.executable_cache.fingerprint((self._identity, key, inputs, [d.id for d in devices]))
        compiled = self.executable_cache.load(fingerprint, devices)
        if compiled is None:
            compiled = self._lower_and_compile_now(key)
            self.executable_cache.store(fingerprint, compiled)
        return compiled

    def _lower_and_compile_now(self, key: ProgramKey) -> jax.stages.Compiled:
        if key[0] == "forward":
            _, t, s, p, stage = key
            return self.stages[stage].lower(t, s, p, self.max_seqs).compile(compiler_options_for(self.device.platform))
        if key[0] == "stage_in":
            _, t, s, p, stage = key
            return self.stages[stage].lower_stage_in(t, s, p).compile(compiler_options_for(self.device.platform))
        spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=self._sample_sharding)
        _, s, k, greedy = key
        sampling = SamplingArrays(spec(jnp.float32, s), spec(jnp.int32, s), spec(jnp.float32, s),
                                  spec(jnp.uint32, s), spec(jnp.int32, s))
        logits = spec(jnp.float32, s, self.config.vocab_size)
        return self._sample_fn.lower(logits, sampling, k, greedy, self.max_seqs).compile(
            compiler_options_for(self.device.platform))

    # ---- one iteration ----

    def forward(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch the forward pass through every stage (asynchronous); returns f32[S, V] logits on
        the last stage's devices. Single process only (execute is what other processes mirror)."""
        if self._mirror is not None:
            raise RuntimeError("with several processes call execute, which the others mirror")
        return self._forward(batch)

    def _forward(self, batch: RaggedBatch) -> jax.Array:
        bucket = batch.token_ids.shape[0], batch.kv_lens.shape[0], batch.page_table.shape[1]
        packed = pack_forward_inputs(batch)  # i32: one host-to-device copy per stage, not nine
        inputs = self._no_tokens if batch.token_sources is None else self._next_tokens
        for stage in self.stages:  # activations [T, H] from stage to stage; logits f32[S, V] last
            if stage.index > 0:
                inputs = self._to_next[stage.index - 1](inputs)
            stage_in = self._executable(("stage_in", *bucket, stage.index)) if self._stages_inputs(bucket[0]) else None
            forward = self._executable(("forward", *bucket, stage.index))
            inputs = stage.run(bucket, stage_in, forward, packed, inputs)
        return inputs

    def sample(self, logits: jax.Array, batch: RaggedBatch) -> jax.Array:
        """Dispatch sampling of a forward's logits; returns the packed i32[S, 2 + 2K] device array."""
        sampling = SamplingArrays(temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p,
                                  seed=batch.seed, step=batch.step)
        key = ("sample", logits.shape[0], batch.num_top_logprobs, batch.all_greedy)
        packed, next_tokens = self._executable(key)(logits, sampling)
        # Sampled on the last stage; a later batch's token sources are read on the first.
        self._next_tokens = self._to_first(next_tokens)
        return self._to_first(packed) if self._result_to_first else packed

    def execute(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch one iteration (asynchronous); returns the packed device result."""
        if self._mirror is not None:
            self._mirror.execute(batch)
        return self.sample(self._forward(batch), batch)

    def stop_workers(self) -> None:
        """With several processes, end the others' worker loops (call on process 0; else a no-op)."""
        if self._mirror is not None:
            self._mirror.stop()

    def prompt_logits(self, token_ids) -> np.ndarray:
        """f32[T, V] next-token logits at every position of one prompt (for parity tests).

        One forward pass of a one-request batch on pages 1..ceil(T / page_size), logits at every row:
        it overwrites those pages' K/V, so call it only on a runner no engine is using.
        """
        n = len(token_ids)
        num_pages = -(-n // self.page_size)
        if n == 0 or num_pages >= self.num_pages:
            raise ValueError(f"{n} tokens need 1..{self.num_pages - 1} pages, not {num_pages}")
        t = s = next_power_of_two(max(n, 8))  # S = T: one logits row per token
        batch = empty_batch(t, s, next_power_of_two(num_pages))
        positions = np.arange(n, dtype=np.int32)
        batch.token_ids[:n] = token_ids
        batch.positions[:n] = positions
        batch.page_table[0, :num_pages] = np.arange(1, num_pages + 1)
        batch.slot_mapping[:n] = batch.page_table[0, positions // self.page_size] * self.page_size \
            + positions % self.page_size
        batch.cu_q_lens[1:] = n
        batch.kv_lens[0] = n
        batch.num_seqs[0] = 1
        batch.logits_indices[:] = np.minimum(np.arange(s), n - 1)
        return np.asarray(self.forward(batch))[:n]

    @staticmethod
    def fetch(packed: jax.Array, batch: RaggedBatch) -> StepResult:
        """Block until the step's tokens are on the host."""
        # Across processes the result is replicated over devices this process owns only some of.
        host = np.asarray(packed if packed.is_fully_addressable else packed.addressable_data(0))
        return StepResult.unpack(host, batch.num_real_seqs, batch.num_top_logprobs)


def _sample(logits, sampling: SamplingArrays, num_top_logprobs: int, all_greedy: bool, max_seqs: int):
    """(packed i32[S, 2 + 2K] for the host, the sampled ids padded to i32[max_seqs] for the device)."""
    result = sample(logits, sampling, num_top_logprobs, all_greedy)
    return pack(result), jnp.pad(result.token_ids, (0, max_seqs - logits.shape[0]))
