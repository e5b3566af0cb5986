"""The compilation manager: which programs an engine runs, compiled ahead of time, cached on disk.

An iteration dispatches compiled programs back to back: per token bucket and pipeline stage a
stage-in (the batch's packed inputs into a buffer that stays put, stage.py) and a forward; then one
sampling program (after penalty-table fills when a batch brings some); with LoRA adapters, a
slot-update program per stage; with prompt logprobs enabled, one prompt-logprobs forward per prompt
length bucket. Their keys are typed (ForwardKey, StageInKey, LoRAUpdateKey, PromptLogprobsKey, and the
sampler's SampleKey and PenaltyFillKey, sample/sampler.py). `precompile` compiles them on a thread
pool (XLA compiles outside the GIL), each one first looked up in the executable cache
(executable_cache.py: serialized executables, loaded without tracing) and in jax's persistent
compilation cache (a fresh compile is written to ours only: not_written_to_jax_cache), so nothing
compiles while serving. A key that was not precompiled still runs, compiled on the spot and logged
as a warning.

The manager knows nothing of models: the runner hands it `source(key)`, which says how to lower a
key's program, on which devices it runs and what its inputs are (for the cache's fingerprint).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import logging
import json
import os
import threading
import time
from typing import Callable, Iterable, NamedTuple

import jax
from jax._src import config as jax_config_states  # the thread-local form of a setting

from orca_jax.sample.mode import SampleMode
from orca_jax.sample.sampler import PenaltyFillKey, SampleKey
from orca_jax.worker.executable_cache import ExecutableCache
from orca_jax.worker.precompile_progress import PhaseEstimate, PrecompilePhase, PrecompileProgress, ProgressFn

log = logging.getLogger(__name__)

AUTO = "auto"  # EngineConfig.compilation_cache_dir: jax's own setting if any, else default_cache_dir()
JAX_SUBDIR = "jax"  # jax's entries in a directory of ours (its executables beside them in "executables")
JAX_CACHE_MAX_BYTES = 8 * 2**30


class Bucket(NamedTuple):
    """A padded batch shape; one forward program per bucket and stage."""

    tokens: int  # T: rows of the ragged token batch
    seqs: int  # S: sequence slots (logits rows)
    pages: int  # P: page-table width


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class ForwardKey:
    """A stage's ragged forward pass over one bucket; with the LoRA adapter term or without (static:
    a batch without adapted tokens skips that work); over the whole KV pool, or the pool while a
    fine-tuning job borrows its top pages (`lent`: the pages' array is smaller, kv_loan.py); for any
    batch, or (`decode`) for batches whose every request feeds one token (Decoder.for_decode); a decode
    forward may also sample its logits (`sampled`, worker/stage.py)."""

    bucket: Bucket
    stage: int
    lora: bool = False
    lent: bool = False
    decode: bool = False
    # -1: the forward hands its logits to the sampling programs; else the SampleMode (GREEDY or SAMPLE)
    # of the plain sampling (no logits processing, no top logprobs) it runs itself.
    sampled: int = -1


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class StageInKey:
    """A stage's copy of one bucket's packed inputs into the buffer its forward reads."""

    bucket: Bucket
    stage: int


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class LoRAUpdateKey:
    """A stage's write of one adapter into one slot of its LoRA table (lora/table.py)."""

    stage: int


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class PromptLogprobsKey:
    """The prompt-logprobs forward over one prompt padded to `length` tokens (prompt_logprobs.py)."""

    length: int


ProgramKey = ForwardKey | StageInKey | SampleKey | PenaltyFillKey | LoRAUpdateKey | PromptLogprobsKey
_KEY_TYPES = {cls.__name__: cls for cls in (ForwardKey, StageInKey, SampleKey, PenaltyFillKey, LoRAUpdateKey,
                                            PromptLogprobsKey)}


def key_to_json(key: ProgramKey) -> list:
    """A key as plain JSON data (several processes send keys to each other)."""
    if isinstance(key, SampleKey):
        return [type(key).__name__, key.seqs, key.num_top_logprobs, int(key.mode), key.logits_processed]
    if isinstance(key, PenaltyFillKey):
        return [type(key).__name__]
    if isinstance(key, LoRAUpdateKey):
        return [type(key).__name__, key.stage]
    if isinstance(key, PromptLogprobsKey):
        return [type(key).__name__, key.length]
    if isinstance(key, ForwardKey):
        return [type(key).__name__, list(key.bucket), key.stage, key.lora, key.lent, key.decode, key.sampled]
    return [type(key).__name__, list(key.bucket), key.stage]


def key_from_json(data: list) -> ProgramKey:
    """The inverse of key_to_json."""
    cls = _KEY_TYPES[data[0]]
    if cls is SampleKey:
        return SampleKey(int(data[1]), int(data[2]), SampleMode(int(data[3])), bool(data[4]))
    if cls is PenaltyFillKey:
        return PenaltyFillKey()
    if cls is LoRAUpdateKey:
        return LoRAUpdateKey(int(data[1]))
    if cls is PromptLogprobsKey:
        return PromptLogprobsKey(int(data[1]))
    if cls is ForwardKey:
        return ForwardKey(Bucket(*(int(x) for x in data[1])), int(data[2]), bool(data[3]), bool(data[4]),
                          bool(data[5]), int(data[6]))
    return cls(Bucket(*(int(x) for x in data[1])), int(data[2]))


@dataclasses.dataclass(frozen=True, slots=True)
class ProgramSource:
    """How to make one program: what the manager needs from the runner for a key."""

    lower: Callable[[], jax.stages.Lowered]
    devices: list[jax.Device]  # where it runs, in mesh order
    inputs: tuple  # a description of its inputs' shapes, dtypes and shardings (for the fingerprint)


def compile_weight(key: ProgramKey) -> float:
    """What a program costs to compile relative to a sampling program (precompile_progress.py has the
    measurements): the forward passes about twice as much, a stage-in (a copy) next to nothing."""
    if isinstance(key, (ForwardKey, PromptLogprobsKey)):
        return 2.0
    return 0.05 if isinstance(key, StageInKey) else 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class PrecompileReport:
    """What `precompile` compiled and how long it took."""

    num_programs: int  # compiled by this call (already compiled ones are skipped)
    compile_seconds: float  # wall time of the (parallel) compilation
    warm_seconds: float  # one run of every new forward program (module load, first-call costs)
    # Each program's own lowering + compiling (or executable-cache load) time, on its worker thread:
    # their sum over compile_seconds is how parallel the compilation was.
    seconds_by_key: dict[ProgramKey, float] = dataclasses.field(default_factory=dict)


def compiler_options_for(platform: str) -> dict | None:
    """XLA options for the engine's programs. On GPU, autotuning skips initializing and checking its
    candidates' buffers (level 1 of 4): a gemm's speed does not depend on the values, and on an H100
    one 8-layer llama-8b forward compiled in 4.5 s instead of 6.0 s (T = 160; 5.4 vs 5.9 s at
    T = 1024) with the same device time. Level 0 (no autotuning) ran 20-45x slower.
    $ORCA_JAX_XLA_OPTIONS (a JSON object) adds options: the backend's own flags reach its compiler
    this way even where jaxlib's XLA_FLAGS parser does not know them."""
    options = {"xla_gpu_autotune_level": 1} if platform == "gpu" else {}
    options.update(json.loads(os.environ.get("ORCA_JAX_XLA_OPTIONS") or "{}"))
    return options or None


def default_cache_dir() -> str:
    """$ORCA_JAX_CACHE_DIR, else $XDG_CACHE_HOME/orca_jax/xla, else ~/.cache/orca_jax/xla."""
    if os.environ.get("ORCA_JAX_CACHE_DIR"):
        return os.environ["ORCA_JAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "orca_jax", "xla")


def configure_compilation_cache(directory: str | None) -> str | None:
    """Point jax's persistent cache at `directory` (AUTO: keep jax's if set); None turns it off.

    jax's cache is a process-wide setting, read when jax first compiles: this runs before a runner
    builds anything. Returns the directory in use, or None when the cache is off. In a directory of
    ours (the default, or one given) jax's entries go to its JAX_SUBDIR, with jax's LRU eviction on:
    that also takes a file lock around every read and write, so processes sharing the directory
    never read an entry half written nor interleave two writes of one (jax writes in place). A
    directory jax was already given (AUTO) is left with the settings it has.
    """
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if directory == AUTO and jax.config.jax_compilation_cache_dir:
        directory = jax.config.jax_compilation_cache_dir
    else:
        directory = default_cache_dir() if directory == AUTO else directory
        jax_directory = os.path.join(directory, JAX_SUBDIR)
        if jax_directory != jax.config.jax_compilation_cache_dir:
            os.makedirs(jax_directory, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", jax_directory)
            if importlib.util.find_spec("filelock") is not None:  # jax's lock needs it
                jax.config.update("jax_compilation_cache_max_size", JAX_CACHE_MAX_BYTES)
            else:
                log.warning("the filelock package is missing: jax's compilation cache in %s is not locked "
                            "against other processes", jax_directory)
            log.info("persistent compilation cache: %s", directory)
    # jax skips programs that compiled in under a second; a start compiles few programs, and the
    # quick ones (drawing random weights, allocating the KV pages) are paid again on every start.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory


def executable_cache_for(cache_dir: str | None) -> ExecutableCache | None:
    """The compilation cache settings applied; the executable cache under it (None: caching off)."""
    directory = configure_compilation_cache(cache_dir)
    return None if directory is None else ExecutableCache(os.path.join(directory, "executables"))


JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring's event for a persistent-cache hit


def compile_noting_jax_cache(lower: Callable[[], jax.stages.Lowered], options: dict | None
                             ) -> tuple[jax.stages.Compiled, bool]:
    """lower().compile(options), and whether jax's persistent cache served it (jax records the hit on
    the compiling thread: several threads may compile at once)."""
    thread = threading.get_ident()
    served = []

    def listen(event: str, **_) -> None:
        if event == JAX_CACHE_HIT_EVENT and threading.get_ident() == thread:
            served.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        compiled = lower().compile(options)
    finally:
        jax.monitoring.unregister_event_listener(listen)
    return compiled, bool(served)


@contextlib.contextmanager
def not_written_to_jax_cache():
    """On this thread, programs compiled are not written to jax's persistent cache (it may still
    serve one it holds). Measured on 4 H200s (jax 0.11.2): the precompile's 16 threads each wrote
    their executables into jax's directory under its one file lock as well as into ours, and waits
    for the lock passed jax's 10 s limit ("The file lock ... could not be acquired": the entry
    skipped, the start slower). jax's setting is thread-local; without it (a jax that moved it)
    this does nothing."""
    state = getattr(jax_config_states, "persistent_cache_min_compile_time_secs", None)
    if state is None:
        yield
        return
    with state(float("inf")):
        yield


def usable_cores() -> int:
    """Cores this process may run on (XLA's compiles are CPU-bound: one thread each)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CompilationManager:
    """Compiled executables by key: precompiled on a pool, loaded from the executable cache where it
    holds them, compiled on demand (with a warning) otherwise."""

    def __init__(self, source: Callable[[ProgramKey], ProgramSource], identity, platform: str,
                 executable_cache: ExecutableCache | None = None):
        self._source = source
        self._identity = identity  # what every program depends on beyond its key and inputs (repr-able)
        self._options = compiler_options_for(platform)
        self._platform = platform
        self.executable_cache = executable_cache
        self._executables: dict[ProgramKey, jax.stages.Compiled] = {}
        self._lock = threading.Lock()

    @property
    def compiled_keys(self) -> frozenset[ProgramKey]:
        """Keys of every compiled program."""
        return frozenset(self._executables)

    @property
    def num_compiled_programs(self) -> int:
        """Programs compiled (or loaded) so far; executables never recompile (a mismatched call raises)."""
        return len(self._executables)

    def precompile(self, keys: Iterable[ProgramKey], progress: ProgressFn | None = None,
                   threads: int | None = None) -> tuple[list[ProgramKey], float, dict[ProgramKey, float]]:
        """Compile every key not compiled yet, in parallel; returns (the keys compiled now, wall
        seconds, each key's own seconds on its thread). `progress` hears of the start and of each
        program done, with an estimate of the time left."""
        todo = [key for key in dict.fromkeys(keys) if key not in self._executables]
        start = time.perf_counter()
        seconds_by_key = {}
        workers = threads or max(1, min(len(todo), usable_cores()))
        estimate = PhaseEstimate(sum(compile_weight(key) for key in todo), workers)
        if progress is not None:
            progress(PrecompileProgress(PrecompilePhase.COMPILING, 0, len(todo), 0.0))

        def timed(key):
            began = time.perf_counter()
            compiled = self._compile(key)
            seconds_by_key[key] = time.perf_counter() - began
            return compiled

        pool = concurrent.futures.ThreadPoolExecutor(workers)
        try:
            futures = {pool.submit(timed, key): key for key in todo}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                key = futures[future]
                self._executables[key] = future.result()
                estimate.step_done(compile_weight(key), seconds_by_key[key])
                if progress is not None:
                    progress(PrecompileProgress(PrecompilePhase.COMPILING, done, len(todo),
                                                time.perf_counter() - start, key, estimate.eta_seconds()))
        except BaseException:  # cancelled, Ctrl-C, a failed compile: what has not begun is not begun
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return todo, time.perf_counter() - start, seconds_by_key

    def executable(self, key: ProgramKey) -> jax.stages.Compiled:
        """The compiled program of `key`; compiled now, with a warning, if it was not precompiled."""
        executable = self._executables.get(key)
        if executable is None:
            with self._lock:
                if key not in self._executables:
                    log.warning("compiling %s on demand (not precompiled); %d programs so far",
                                key, len(self._executables) + 1)
                    self._executables[key] = self._compile(key)
            executable = self._executables[key]
        return executable

    def _compile(self, key: ProgramKey) -> jax.stages.Compiled:
        """From the executable cache where it holds the program, else lowered and compiled (and kept)."""
        source = self._source(key)
        if self.executable_cache is None:
            return source.lower().compile(self._options)
        fingerprint = self.executable_cache.fingerprint(
            (self._identity, self._options, key_to_json(key), source.inputs, [d.id for d in source.devices]))
        compiled = self.executable_cache.load(fingerprint, source.devices)
        if compiled is None:
            with not_written_to_jax_cache():  # ours holds it; jax's would store it a second time
                compiled, from_jax_cache = compile_noting_jax_cache(source.lower, self._options)
            if from_jax_cache and self._platform == "cpu":
                # Measured (jax 0.10.2): an XLA:CPU executable that jax's cache served serializes without
                # its kernels, and loads to fail its first run ("NOT_FOUND: Function ... not found").
                # Only a fresh compile is stored; this one runs fine as it is.
                log.debug("not caching %s: jax's persistent cache served it", key)
            else:
                self.executable_cache.store(fingerprint, compiled)
        return compiled
