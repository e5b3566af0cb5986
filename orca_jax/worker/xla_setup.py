"""XLA options an engine on GPUs sets before jax starts its GPU backend.

One device: `--xla_gpu_command_buffer_update_mode=SKIP_TEMP` (which takes XLA's VMM allocator). XLA
runs a forward as one CUDA graph but allocates its temporaries afresh on every call; with the BFC
allocator they land at another address each step, and XLA then re-records the whole graph: llama-1b's
249-command forward was updated on every decode step (0.72-0.95 ms each, on an H200), while none of
its arguments or outputs moved (benchmarks/probes/step_buffers.sh). With SKIP_TEMP the temporaries
keep fixed addresses and the recorded graph is replayed as it is.

XLA runs a forward as a CUDA graph (a command buffer), but in jax 0.11.2 it leaves collectives out of
it by default, and its one-shot all-reduce kernel (on by default) has no command form at all: a
tensor-parallel llama-8b forward then becomes 64 graphs and 64 collective launches per device, about
4.7 ms of host launching for 3.5 ms of device work on two H200s (benchmarks/results/h200x2/notes.md).
These options record the all-reduces into the forward's one graph as NCCL calls:
- `--xla_gpu_enable_command_buffer=+COLLECTIVES` and the one-shot kernel off (the kernel would end
  the graph at every all-reduce);
- `--xla_gpu_command_buffer_update_mode=SKIP_TEMP`: temporaries at fixed addresses (VMM allocator);
  a recorded NCCL call whose buffer moved is re-recorded with a rendezvous of the devices;
- NCCL symmetric buffers (`--xla_gpu_experimental_enable_nccl_symmetric_buffers`, with a collective
  memory space of XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB): NCCL's low-latency kernels for the small
  all-reduces of decode.
Measured (benchmarks/probes/tp_flags.sh, llama-8b batch-1 decode, 2 H200s): 7.24 ms per step with
XLA's defaults, 4.12 ms with these. The engine's own arguments stay put too (stage.py, sampler.py).

Every option is read when the backend starts, from the environment: `prepare` adds them to XLA_FLAGS
(never overriding one already there) if jax has not started yet, else it can only warn. One device
takes SINGLE_DEVICE_FLAGS only, and several controller processes keep XLA's defaults: collectives
recorded into graphs have hung multi-process jobs elsewhere.
$ORCA_JAX_XLA_DEFAULTS=0 turns all of this off.

What `prepare` changed stays in this process's environment, which a spawned process inherits: an engine
core spawned later (a data-parallel replica of one device, say) would start with a tensor-parallel
layout's options. `spawn_environment()` puts the environment back as the user set it around a spawn;
the child's own engine then prepares its own layout's options.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from orca_jax.config import ParallelConfig

log = logging.getLogger(__name__)

TENSOR_PARALLEL_FLAGS = (
    "--xla_gpu_enable_command_buffer=+COLLECTIVES",
    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false",
    "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true",
)
SINGLE_DEVICE_FLAGS = ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP",)
COLLECTIVE_MEMORY_MB = "64"  # the symmetric buffers' space per device; decode's all-reduces are KBs
_ENV_NAMES = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB")
# Each of _ENV_NAMES as it was before `prepare` first changed it (None: unset); empty until then.
_user_values: dict[str, str | None] = {}
_env_lock = threading.RLock()  # prepare() inside spawn_environment() must not deadlock


def gpu_expected() -> bool:
    """Whether jax will start on NVIDIA GPUs: a CUDA plugin is installed and JAX_PLATFORMS allows it."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    import importlib.util

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is not there
            return False
    return any(installed(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                                            "jax_plugins.xla_cuda12"))


def flags_for(parallel: ParallelConfig) -> tuple[str, ...]:
    """The XLA flags an engine of this layout wants (none for several processes or off GPU)."""
    if parallel.num_processes > 1 or os.environ.get("ORCA_JAX_XLA_DEFAULTS") == "0" or not gpu_expected():
        return ()
    return SINGLE_DEVICE_FLAGS if parallel.tensor_parallel == 1 else TENSOR_PARALLEL_FLAGS


def merged(xla_flags: str, wanted: tuple[str, ...]) -> str:
    """`xla_flags` with each of `wanted` whose name it does not set already."""
    present = {flag.split("=", 1)[0] for flag in xla_flags.split()}
    return " ".join([xla_flags.strip()] + [f for f in wanted if f.split("=", 1)[0] not in present]).strip()


def backend_started() -> bool:
    from jax._src import xla_bridge
    return bool(getattr(xla_bridge, "_backends", {}))


def prepare(parallel: ParallelConfig) -> bool:
    """Set this layout's XLA options in the environment; True if they were added before jax started
    (they then hold for every program of this process)."""
    wanted = flags_for(parallel)
    current = os.environ.get("XLA_FLAGS", "")
    if not wanted:
        return False
    collectives = parallel.tensor_parallel > 1  # the symmetric buffers' memory space
    if merged(current, wanted) == current.strip():  # all set already (by the user, or an earlier engine)
        if collectives and not backend_started():
            _set("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", COLLECTIVE_MEMORY_MB, only_if_unset=True)
        return True
    if backend_started():
        if parallel.tensor_parallel > 1:  # a warning here is read past, and the layout then loses its point
            raise RuntimeError(
                "jax started before this tensor-parallel engine, so XLA runs without the options that record "
                f"its all-reduces into CUDA graphs (about 1.4x slower). Build the engine (LLM(...)) before "
                f"anything touches jax (jax.devices(), an array), or start Python with XLA_FLAGS=\"{' '.join(wanted)}\"; "
                "ORCA_JAX_XLA_DEFAULTS=0 runs it without them")
        log.warning("jax started before the engine: decode steps run without XLA's %s (each step's CUDA graph "
                    "is updated, slower for small models); build the engine before using jax, or set "
                    "XLA_FLAGS=%r", " ".join(wanted), " ".join(wanted))
        return False
    _set("XLA_FLAGS", merged(current, wanted))
    if collectives:
        _set("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", COLLECTIVE_MEMORY_MB, only_if_unset=True)
    return True


def _set(name: str, value: str, *, only_if_unset: bool = False) -> None:
    with _env_lock:
        if only_if_unset and name in os.environ:
            return
        _user_values.setdefault(name, os.environ.get(name))
        os.environ[name] = value


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """The environment as the user set it, for the span of a process's start (what `prepare` added
    is put back afterwards): the spawned process chooses its own options. The environment is the
    process's: another thread starting a process meanwhile sees the user's settings too."""
    with _env_lock:
        ours = {name: os.environ.get(name) for name in _user_values}
        try:
            for name, value in _user_values.items():
                _put(name, value)
            yield
        finally:
            for name, value in ours.items():
                _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
