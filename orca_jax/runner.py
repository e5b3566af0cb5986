"""Owns the params and the KV pages on device and runs one jitted iteration per bucket.

An iteration is two programs dispatched back to back: the ragged forward pass with the K/V writes
into the (donated) cache, compiled per (T, S, P) bucket, and sampling, compiled per (S, K) only (its
sorts and random draws are slow to compile, so they stay out of the many forward buckets). Logits
stay on device; only a small packed i32[S, 2 + 2K] array of token ids and logprobs reaches the host.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time

import jax
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orca_jax.batch import MIN_PAGES_BUCKET, MIN_TOKENS_BUCKET, RaggedBatch, empty_batch, round_up_pow2
from orca_jax.config import AttentionBackend, CacheConfig, ModelConfig, ParallelConfig
from orca_jax.kernels import ragged_attention as ragged
from orca_jax.kv_cache import pages_for_budget
from orca_jax.models import decoder
from orca_jax.models.attention import AttentionMetadata, KVCache
from orca_jax.sampling import SamplingArrays, pack, sample
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR, check_parallel_fits, make_mesh

log = logging.getLogger(__name__)

_CPU_DEFAULT_KV_GIB = 0.5
_GPU_KV_FRACTION = 0.85  # of the memory left after the weights


def choose_attention(backend: AttentionBackend, platform: str):
    """The ragged attention implementation for a backend choice on a platform."""
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.PALLAS if platform == "gpu" else AttentionBackend.JNP
    if backend is AttentionBackend.JNP:
        return ragged.ragged_attention_reference
    # Off GPU the kernel can only run in interpret mode (slow, for tests).
    return functools.partial(ragged.ragged_attention, interpret=platform != "gpu")


def shard_over_heads(attention_fn, mesh: Mesh):
    """Attention is independent per head: run it on each tensor shard's own heads and KV pages."""
    if mesh.shape[TENSOR] == 1:
        return attention_fn
    replicated = P()
    return jax.shard_map(
        attention_fn, mesh=mesh,
        in_specs=(rules.HEADS_SPEC, rules.KV_CACHE_SPEC, rules.KV_CACHE_SPEC) + (replicated,) * 5,
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


class ModelRunner:
    """Params + KV cache on device; `execute` dispatches a step, `fetch` waits for its tokens."""

    def __init__(self, config: ModelConfig, params, cache_config: CacheConfig,
                 backend: AttentionBackend = AttentionBackend.AUTO, seed: int = 0,
                 parallel: ParallelConfig = ParallelConfig(), devices: list[jax.Device] | None = None,
                 unroll_layers: bool = False):
        check_parallel_fits(parallel, config)
        self.config = config
        self.mesh = make_mesh(parallel, devices)
        self.device = self.mesh.devices.flat[0]
        self.attention_fn = shard_over_heads(choose_attention(backend, self.device.platform), self.mesh)
        start = time.perf_counter()
        shardings = rules.param_shardings(decoder.param_shapes(config, self.attention_fn), self.mesh)
        if params is None:
            self.params = decoder.init_params(config, self.attention_fn, seed, out_shardings=shardings)
        else:
            self.params = jax.device_put(params, shardings)
        jax.block_until_ready(self.params)
        self.params_seconds = time.perf_counter() - start
        params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.params))
        self.page_size = cache_config.page_size
        self.num_pages = num_pages_for(config, cache_config, params_bytes // self.mesh.size, self.device,
                                       self.mesh.size)
        # Made on device, already sharded and committed like every later cache (so no second compile).
        cache_sharding = NamedSharding(self.mesh, rules.KV_CACHE_SPEC)
        self.cache = jax.jit(lambda: decoder.empty_cache(config, self.num_pages, self.page_size),
                             out_shardings=KVCache(cache_sharding, cache_sharding))()
        self._compiled_shapes: set[tuple[int, ...]] = set()
        self._executables: dict[tuple, object] = {}  # ahead-of-time compiled programs (precompile)
        model = decoder.Decoder(config, self.attention_fn, scan_unroll=config.num_layers if unroll_layers else 1)
        # The cache goes out with the sharding it came in with; else the second call recompiles.
        self._forward = jax.jit(functools.partial(_forward, model), donate_argnums=(1,),
                                out_shardings=(NamedSharding(self.mesh, P()),
                                               KVCache(cache_sharding, cache_sharding)))
        self._sample = jax.jit(lambda logits, sampling, k, greedy: pack(sample(logits, sampling, k, greedy)),
                               static_argnums=(2, 3))

    def execute(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch one iteration (asynchronous); returns the packed device result."""
        return self.sample(self.forward(batch), batch)

    @property
    def num_compiled_programs(self) -> int:
        """What jax itself has compiled; equals the buckets seen unless something recompiles."""
        return self._forward._cache_size() + self._sample._cache_size()

    @staticmethod
    def fetch(packed: jax.Array, batch: RaggedBatch) -> StepResult:
        """Block until the step's tokens are on the host."""
        return StepResult.unpack(np.asarray(packed), batch.num_real_seqs, batch.num_top_logprobs)

    # ---- seams: the two programs apart, precompilation, compiled-shape view ----------------------
    @property
    def compiled_shapes(self) -> frozenset[tuple]:
        """("forward", T, S, P) and ("sample", S, K, greedy) keys of every program used or precompiled."""
        return frozenset(self._compiled_shapes)

    def _note_shape(self, key: tuple) -> None:
        if key not in self._compiled_shapes:
            self._compiled_shapes.add(key)
            log.info("compiling %s for bucket %s; %d programs so far", key[0], key[1:],
                     len(self._compiled_shapes))

    def forward(self, batch: RaggedBatch) -> jax.Array:
        """Dispatch the forward pass (K/V written into the donated cache); f32[S, V] logits on device."""
        t, s, p, _, _ = batch.shape_key
        key = ("forward", t, s, p)
        self._note_shape(key)
        meta = AttentionMetadata(cu_q_lens=batch.cu_q_lens, kv_lens=batch.kv_lens,
                                 page_table=batch.page_table, slot_mapping=batch.slot_mapping,
                                 num_seqs=batch.num_seqs)
        fn = self._executables.get(key, self._forward)
        logits, self.cache = fn(self.params, self.cache, batch.token_ids, batch.positions, meta,
                                batch.logits_indices)
        return logits

    def sample(self, logits: jax.Array, batch: RaggedBatch) -> jax.Array:
        """Dispatch sampling of forward()'s logits; the packed i32[S, 2 + 2K] device result."""
        _, s, _, k, greedy = batch.shape_key
        key = ("sample", s, k, greedy)
        self._note_shape(key)
        sampling = SamplingArrays(temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p,
                                  seed=batch.seed, step=batch.step)
        exe = self._executables.get(key)
        if exe is not None:  # compiled with k and greedy baked in: they leave the signature
            return exe(logits, sampling)
        return self._sample(logits, sampling, k, greedy)

    def prompt_logits(self, token_ids) -> np.ndarray:
        """f32[T, V] next-token logits at every position of one prompt (for parity tests).

        One forward pass of a one-request batch whose pages are 1..ceil(T / page_size): it overwrites
        their K/V, so call it only on a runner no engine is using.
        """
        n = len(token_ids)
        num_pages = -(-n // self.page_size)
        if n == 0 or num_pages >= self.num_pages:
            raise ValueError(f"{n} tokens need 1..{self.num_pages - 1} pages, not {num_pages}")
        t = s = round_up_pow2(n, MIN_TOKENS_BUCKET)
        p = round_up_pow2(num_pages, MIN_PAGES_BUCKET)
        batch = empty_batch(t, s, p)
        positions = np.arange(n, dtype=np.int32)
        batch.token_ids[:n] = token_ids
        batch.positions[:n] = positions
        batch.page_table[0, :num_pages] = np.arange(1, num_pages + 1)
        batch.slot_mapping[:n] = batch.page_table[0, positions // self.page_size] * self.page_size \
            + positions % self.page_size
        batch.cu_q_lens[1:] = n
        batch.kv_lens[0] = n
        batch.num_seqs[0] = 1
        batch.logits_indices[:] = np.minimum(np.arange(s), n - 1)  # a row per position: S = T here
        return np.asarray(self.forward(batch))[:n]

    def precompile(self, shape_keys, progress=None, threads: int | None = None) -> float:
        """Compile ahead of time the programs of RaggedBatch.shape_key tuples (T, S, P, K, greedy).

        Lowered and compiled on a thread pool (XLA compiles outside the GIL); later calls of those
        shapes run the kept executables. progress(done, total) is called as programs finish.
        Returns the seconds it took.
        """
        keys = sorted(set(shape_keys))
        forwards = sorted({("forward", t, s, p) for t, s, p, _, _ in keys} - set(self._executables))
        samples = sorted({("sample", s, k, g) for _, s, _, k, g in keys} - set(self._executables))
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731

        def lower_forward(key):
            _, t, s, p = key
            meta = AttentionMetadata(cu_q_lens=i32(s + 1), kv_lens=i32(s), page_table=i32(s, p),
                                     slot_mapping=i32(t), num_seqs=i32(1))
            return self._forward.lower(self.params, self.cache, i32(t), i32(t), meta, i32(s)).compile()

        def lower_sample(key):
            _, s, k, greedy = key
            sampling = SamplingArrays(f32(s), i32(s), f32(s), jax.ShapeDtypeStruct((s,), np.uint32), i32(s))
            return self._sample.lower(f32(s, self.config.vocab_size), sampling, k, greedy).compile()

        start = time.perf_counter()
        jobs = [(key, lower_forward) for key in forwards] + [(key, lower_sample) for key in samples]
        with concurrent.futures.ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
            futures = {pool.submit(fn, key): key for key, fn in jobs}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                self._executables[key] = future.result()
                self._compiled_shapes.add(key)
                if progress is not None:
                    progress(done, len(jobs))
        return time.perf_counter() - start


def _forward(model: decoder.Decoder, params, cache: KVCache, token_ids, positions, meta, logits_indices):
    return model.apply({"params": params}, token_ids, positions, cache, meta, logits_indices)
