"""Owns the params and the per-layer KV pages on device, and the compiled programs of each bucket.

An iteration is two programs dispatched back to back: the ragged forward pass with the K/V writes
into the (donated) per-layer pages, one program per (T, S, P) bucket, and sampling, one per (S, K,
greedy) (its sorts and random draws are slow to compile, so they stay out of the forward buckets).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.batch import RaggedBatch, empty_batch, next_power_of_two
from orca_jax.config import AttentionBackend, CacheConfig, ModelConfig, ParallelConfig
from orca_jax.kernels import ragged_attention as ragged
from orca_jax.kv_cache import pages_for_budget
from orca_jax.kernels.ragged_attention_blocked import ragged_attention_blocked
from orca_jax.models import decoder
from orca_jax.models.attention import AttentionMetadata, LayerKV
from orca_jax.sampling import SamplingArrays, pack, sample
from orca_jax.sharding import rules, tensor_plan
from orca_jax.sharding.mesh import TENSOR, check_parallel_fits, make_mesh

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_GIB = 0.5
_GPU_KV_FRACTION = 0.85  # of the memory left after the weights

# Program keys: ("forward", T, S, P) and ("sample", S, K, all_greedy).
ProgramKey = tuple
# progress(done, total, key, seconds): called as each program finishes compiling.
ProgressFn = Callable[[int, int, ProgramKey, float], None]


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


def num_pages_for(config: ModelConfig, cache: CacheConfig, params_bytes: int, device: jax.Device,
                  num_devices: int = 1) -> int:
    """The pool size: explicit, or the largest that fits the memory budget (per device x devices)."""
    if cache.num_pages is not None:
        return cache.num_pages
    if cache.kv_memory_gib is not None:
        budget = cache.kv_memory_gib * 2**30
    elif device.platform == "gpu":
        stats = device.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", params_bytes)
        budget = max(free, 0) * _GPU_KV_FRACTION * num_devices
    else:
        budget = _CPU_DEFAULT_KV_GIB * 2**30
    return max(2, pages_for_budget(config.kv_bytes_per_token, cache.page_size, int(budget)))


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


class ModelRunner:
    """Params + per-layer KV on device; `execute` dispatches a step, `fetch` waits for its tokens."""

    def __init__(self, config: ModelConfig, params, cache_config: CacheConfig,
                 backend: AttentionBackend = AttentionBackend.AUTO, seed: int = 0,
                 parallel: ParallelConfig = ParallelConfig(), devices: list[jax.Device] | None = None,
                 max_seqs: int = 256):
        check_parallel_fits(parallel, config)
        # Vocabulary padded and KV heads replicated to fit the tensor size; from here on `config` is
        # the device shapes (the logits width, the KV pages), the plan keeps the model's own.
        self.tensor_plan = tensor_plan.plan_for(config, parallel.tensor_parallel)
        config = self.tensor_plan.device
        self.config = config
        self.max_seqs = max_seqs  # the most sequences one batch holds: the width of next_tokens
        self.mesh = make_mesh(parallel, devices)
        self.device = self.mesh.devices.flat[0]
        self.attention_fn = shard_over_heads(choose_attention(backend, self.device.platform), self.mesh)
        self.decoder = decoder.Decoder(config, self.attention_fn, real_vocab_size=self.tensor_plan.vocab_size)
        start = time.perf_counter()
        shardings = rules.param_shardings(decoder.param_shapes(config), self.mesh)
        if params is None:
            self.params = decoder.init_params(self.tensor_plan.model, seed, out_shardings=shardings,
                                              adapt=self.tensor_plan.adapt_params)
        else:
            self.params = jax.device_put(self.tensor_plan.adapt_params(decoder.unstack_layers(params)),
                                         shardings)
        jax.block_until_ready(self.params)
        self.params_seconds = time.perf_counter() - start
        self.params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.params))
        self.page_size = cache_config.page_size
        self.num_pages = num_pages_for(config, cache_config, self.params_bytes // self.mesh.size,
                                       self.device, self.mesh.size)
        layer_sharding = NamedSharding(self.mesh, rules.KV_CACHE_SPEC)
        self._kv_shardings = tuple(LayerKV(layer_sharding, layer_sharding) for _ in range(config.num_layers))
        self._replicated = NamedSharding(self.mesh, P())
        # Made on device, already sharded like every later cache (so the first step does not recompile).
        self.kv = jax.jit(lambda: decoder.empty_cache(config, self.num_pages, self.page_size),
                          out_shardings=self._kv_shardings)()
        # The pages go out with the sharding they came in with; else the second call would recompile.
        self._forward_fn = jax.jit(_forward, static_argnums=(0,), donate_argnums=(2,),
                                   out_shardings=(self._replicated, self._kv_shardings))
        self._sample_fn = jax.jit(_sample, static_argnums=(2, 3, 4))
        # The last sampled token of every row, on device, for a batch dispatched before they reach the
        # host (see RaggedBatch.token_sources). Nothing sampled yet: zeros.
        self._next_tokens = jax.device_put(np.zeros(max_seqs, np.int32), self._replicated)
        self._executables: dict[ProgramKey, jax.stages.Compiled] = {}
        self._compile_lock = threading.Lock()

    # ---- compiled programs ----

    @property
    def compiled_shapes(self) -> frozenset[ProgramKey]:
        """Keys of every compiled program: ("forward", T, S, P) and ("sample", S, K, greedy)."""
        return frozenset(self._executables)

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled so far; executables never recompile (a mismatched call raises)."""
        return len(self._executables)

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the whole KV pool, all layers and shards."""
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self.kv))

    def precompile(self, keys: Iterable[ProgramKey], progress: ProgressFn | None = None,
                   threads: int | None = None, warm: bool = True) -> PrecompileReport:
        """Compile every program in `keys` ahead of time; then run each new forward once on padding."""
        todo = [key for key in dict.fromkeys(keys) if key not in self._executables]
        start = time.perf_counter()
        workers = threads or min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(self._lower_and_compile, key): key for key in todo}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                self._executables[key] = future.result()
                if progress is not None:
                    progress(done, len(todo), key, time.perf_counter() - start)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if warm:
            for key in todo:
                if key[0] == "forward":
                    _, t, s, p = key
                    jax.block_until_ready(self.forward(empty_batch(t, s, p)))
        return PrecompileReport(len(todo), compile_seconds, time.perf_counter() - start)

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
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._replicated)
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self._replicated)
        if key[0] == "forward":
            _, t, s, p = key
            meta = AttentionMetadata(cu_q_lens=i32(s + 1), kv_lens=i32(s), page_table=i32(s, p),
                                     slot_mapping=i32(t), num_seqs=i32(1))
            lowered = self._forward_fn.lower(self.decoder, self.params, self.kv, i32(t), i32(t),
                                             i32(self.max_seqs), i32(t), meta, i32(s))
        else:
            _, s, k, greedy = key
            sampling = SamplingArrays(f32(s), i32(s), f32(s),
                                      jax.ShapeDtypeStruct((s,), jnp.uint32, sharding=self._replicated),
                                      i32(s))
            lowered = self._sample_fn.lower(f32(s, self.config.vocab_size), sampling, k, greedy, self.max_seqs)
        return lowered.compile()

    # ---- one iteration ----

    def forward(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch the forward pass (asynchronous); returns f32[S, V] logits on device."""
        t, s, p = batch.token_ids.shape[0], batch.kv_lens.shape[0], batch.page_table.shape[1]
        meta = AttentionMetadata(cu_q_lens=batch.cu_q_lens, kv_lens=batch.kv_lens,
                                 page_table=batch.page_table, slot_mapping=batch.slot_mapping,
                                 num_seqs=batch.num_seqs)
        sources = batch.token_sources if batch.token_sources is not None else np.full(t, -1, np.int32)
        logits, self.kv = self._executable(("forward", t, s, p))(
            self.params, self.kv, batch.token_ids, sources, self._next_tokens, batch.positions, meta,
            batch.logits_indices)
        return logits

    def sample(self, logits: jax.Array, batch: RaggedBatch) -> jax.Array:
        """Dispatch sampling of a forward's logits; returns the packed i32[S, 2 + 2K] device array."""
        sampling = SamplingArrays(temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p,
                                  seed=batch.seed, step=batch.step)
        key = ("sample", logits.shape[0], batch.num_top_logprobs, batch.all_greedy)
        packed, self._next_tokens = self._executable(key)(logits, sampling)
        return packed

    def execute(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch one iteration (asynchronous); returns the packed device result."""
        return self.sample(self.forward(batch), batch)

    @staticmethod
    def fetch(packed: jax.Array, batch: RaggedBatch) -> StepResult:
        """Block until the step's tokens are on the host."""
        return StepResult.unpack(np.asarray(packed), batch.num_real_seqs, batch.num_top_logprobs)

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


def _forward(model: decoder.Decoder, params, kv, token_ids, token_sources, prev_tokens, positions, meta,
             logits_indices):
    # token_ids: i32[T] from the host; token_sources: i32[T], -1 or the row of prev_tokens
    # (i32[max_seqs], the previous iteration's samples, still on device) that holds the token.
    token_ids = jnp.where(token_sources >= 0, prev_tokens[jnp.maximum(token_sources, 0)], token_ids)
    return model(params, kv, token_ids, positions, meta, logits_indices)


def _sample(logits, sampling: SamplingArrays, num_top_logprobs: int, all_greedy: bool, max_seqs: int):
    """(packed i32[S, 2 + 2K] for the host, the sampled ids padded to i32[max_seqs] for the device)."""
    result = sample(logits, sampling, num_top_logprobs, all_greedy)
    return pack(result), jnp.pad(result.token_ids, (0, max_seqs - logits.shape[0]))
