"""Compiled programs kept on disk and loaded without tracing: what makes a warm start fast.

JAX's persistent compilation cache skips XLA's compile, but it still traces and lowers each program
to find the cache key. For llama-8b on an H100 that was most of a warm start (46 programs in 40 s,
before each layer was traced once per program), and tracing holds the GIL, so the runner's compile
threads cannot overlap it. This cache keys each
serialized executable by what its trace depends on, all known before tracing: the program's
identity as the runner describes it (program key, model config, attention kernel, meshes), the
shapes, dtypes and shardings of its inputs, the orca_jax source, jax's version, the devices and, on
the CPU, the host's instruction set (XLA:CPU compiles for the features of the machine it runs on). A
hit is deserialized; a miss is lowered and compiled as usual (through jax's cache) and stored.

Several processes may share the directory (servers, benchmarks, tests): an entry is written to a
temporary file and renamed into place, so nobody reads half of one, and it carries its own
fingerprint and the digest of its bytes, so a damaged, truncated or misplaced entry is never loaded:
it is dropped, compiled again and replaced. A cache never fails a start.

Only for one controller process: an executable of several processes is theirs together.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import platform
import tempfile
import threading
import time

import flax
import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Context-manager state and the axis environment: empty outside a trace, and their reprs hold
# memory addresses (a fingerprint with them would never match another process's).
_UNSTABLE_TRACE_SETTINGS = ("mesh_context_manager", "abstract_mesh_context_manager",
                            "compute_on_context_manager", "xla_metadata_context_manager",
                            "pallas_tpu_interpret_mode_context_manager", "user_context", "axis_env_state")
# Settings outside jax's trace context that still change a program: random bits and XLA's effort.
_COMPILE_SETTINGS = ("jax_default_prng_impl", "jax_optimization_level", "jax_memory_fitting_level",
                     "jax_exec_time_optimization_effort", "jax_memory_fitting_effort")


def source_digest() -> str | None:
    """sha256 of every .py file of the package (None without any: then nothing is cached)."""
    digest, found = hashlib.sha256(), False
    for root, dirs, files in os.walk(_PACKAGE_DIR):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, _PACKAGE_DIR).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
            found = True
    return digest.hexdigest() if found else None


# The code this process runs is the code imported now: a file saved while an engine starts must not
# label the old code's programs with the new code's digest (store() checks the digest again).
IMPORTED_SOURCE_DIGEST = source_digest()


def _trace_settings() -> tuple:
    from jax._src import config as jax_config  # the list of settings jax's own jit cache keys on
    names = getattr(jax_config, "trace_context_names", lambda: ())()
    values = jax_config.trace_context() if names else ()
    traced = tuple((n, v) for n, v in zip(names, values) if n not in _UNSTABLE_TRACE_SETTINGS)
    return traced + tuple((n, getattr(jax.config, n, None)) for n in _COMPILE_SETTINGS)


@functools.lru_cache(maxsize=1)
def _library_versions() -> tuple:
    """Versions of what shapes a program besides jax: flax builds the layers, numpy the constants,
    the CUDA plugin holds XLA's GPU compiler."""
    plugins = sorted((d.metadata["Name"], d.version) for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jaxlib")))
    return (jax.__version__, jaxlib.__version__, flax.__version__, np.__version__, tuple(plugins))


def describe_arrays(tree) -> list[tuple]:
    """(path, shape, dtype, sharding spec, device ids) of every array leaf: a program's inputs."""
    def one(path, x):
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        devices = sorted(d.id for d in sharding.device_set) if sharding is not None else None
        return (jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), str(spec), devices)
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map_with_path(one, tree),
                                     is_leaf=lambda leaf: isinstance(leaf, tuple))


@functools.lru_cache(maxsize=1)
def host_identity() -> tuple[str, str]:
    """The CPU architecture and a digest of its feature flags (Linux's /proc/cpuinfo): XLA:CPU
    compiles for the host it runs on, so its executables are not another machine's."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine(), hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


DEFAULT_MAX_BYTES = 4 * 2**30  # a few models' programs; every code change starts a new set
# An entry: this line, its fingerprint (64 hex digits), the sha256 of the rest, then the pickled
# serialized executable. Entries of the older form (a bare pickle) fail the check and are replaced.
_ENTRY_MAGIC = b"orca_jax executable v2\n"
_FINGERPRINT_BYTES = 64
_DIGEST_BYTES = 32
# Loads that run at once; the precompile's other threads compile misses meanwhile. llama-8b's 43
# programs on an H100 loaded in 2.4 s four at a time, 3.6-4.4 s sixteen at a time and 5.0 s one at a
# time: past a few, loads slow each other down (on what is not known; 2.4 of 16 cores were busy).
LOADS_AT_ONCE = 4


class ExecutableCache:
    """Serialized executables in `directory`, one file per fingerprint, the least recently used
    removed once they pass max_bytes together (each source change makes a new set: without a cap a
    developer's cache would only grow). Disk trouble never stops an engine: a program that cannot be
    stored or read is compiled as if the cache were off."""

    def __init__(self, directory: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the precompile threads count concurrently
        self._loading = threading.BoundedSemaphore(LOADS_AT_ONCE)
        self.enabled = IMPORTED_SOURCE_DIGEST is not None and self._usable()
        # Read the installed packages' metadata now: the precompile's threads would all read it at
        # once (the cache below fills only after a first call returns), each holding the GIL.
        _library_versions()

    def _usable(self) -> bool:
        try:
            # 0700 whatever the umask (0002 is common): the check below must pass on our own directory.
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            info = os.stat(self.directory)
        except OSError as error:
            log.warning("executable cache off: %s is unusable (%r)", self.directory, error)
            return False
        # Entries are unpickled: a directory others can write to could hand this process code.
        if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
            log.warning("executable cache off: %s is not this user's alone", self.directory)
            return False
        return True

    @staticmethod
    def fingerprint(identity) -> str:
        """A file name for the program `identity` describes (any repr-able, deterministic value)."""
        device = jax.devices()[0]
        kinds = sorted({d.device_kind for d in jax.devices()})
        context = (IMPORTED_SOURCE_DIGEST, _library_versions(), device.platform, kinds,
                   device.client.platform_version, jax.device_count(), os.environ.get("XLA_FLAGS"),
                   _trace_settings(), host_identity() if device.platform == "cpu" else None)
        return hashlib.sha256(repr((context, identity)).encode()).hexdigest()

    def _path(self, fingerprint: str) -> str:
        return os.path.join(self.directory, f"{fingerprint}.bin")

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def load(self, fingerprint: str, devices: list[jax.Device]) -> jax.stages.Compiled | None:
        """The stored executable, loaded onto `devices` (its mesh's, in mesh order: the fingerprint
        must cover their ids), or None: absent, unreadable (kept), or damaged, not this program's or
        not loadable by this jax (removed, so that the compile that follows replaces it)."""
        if not self.enabled:
            self._count(hit=False)
            return None
        path = self._path(fingerprint)
        try:
            with open(path, "rb") as f:
                entry = f.read()
        except OSError:  # absent, or another user's file: compile, leave it be
            self._count(hit=False)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(_checked_payload(entry, fingerprint))
            with self._loading:
                compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                     backend=devices[0].client,
                                                                     execution_devices=devices)
        except Exception as error:  # noqa: BLE001 - a bad entry costs a compile, never a failure
            log.warning("dropping cached executable %s, which cannot be used (%s); compiling it again",
                        path, error)
            self._count(hit=False)
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        self._count(hit=True)
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return compiled

    def store(self, fingerprint: str, compiled: jax.stages.Compiled) -> None:
        """Write atomically (a reader never sees half a file). Skipped, with a log line, for programs
        that cannot be serialized, when the package's files changed since import, and on any disk
        error."""
        if not self.enabled:
            return
        if source_digest() != IMPORTED_SOURCE_DIGEST:
            log.warning("not caching executables: orca_jax's files changed since this process imported them")
            self.enabled = False
            return
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as error:  # noqa: BLE001 - not every executable serializes
            log.debug("not caching an executable that cannot be serialized: %r", error)
            return
        blob = _ENTRY_MAGIC + fingerprint.encode().ljust(_FINGERPRINT_BYTES)[:_FINGERPRINT_BYTES] \
            + hashlib.sha256(payload).digest() + payload
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide entries from tools that copy the cache
            os.replace(tmp, self._path(fingerprint))
            tmp = None
            self._evict()
        except OSError as error:
            log.warning("could not store a cached executable in %s: %r", self.directory, error)
        finally:
            if tmp is not None:
                try:
                    os.remove(tmp)
                except OSError:
                    pass

    def _evict(self) -> None:
        """Remove the least recently used entries until the rest fit in max_bytes, and temporary
        files an interrupted write left more than an hour ago."""
        entries = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            try:
                info = os.stat(path)
                if name.endswith(".tmp") and info.st_mtime < time.time() - 3600:
                    os.remove(path)
                elif name.endswith(".bin"):
                    entries.append((info.st_mtime, info.st_size, name))
            except FileNotFoundError:
                continue  # another process got there first
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.remove(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
            total -= size


def _checked_payload(entry: bytes, fingerprint: str) -> bytes:
    """The pickled executable of an entry read from disk; ValueError unless it is whole and is the
    entry of `fingerprint` (a file copied or renamed over another program's is not)."""
    head = len(_ENTRY_MAGIC) + _FINGERPRINT_BYTES + _DIGEST_BYTES
    if len(entry) < head or not entry.startswith(_ENTRY_MAGIC):
        raise ValueError("not an entry of this cache's format")
    named = entry[len(_ENTRY_MAGIC):len(_ENTRY_MAGIC) + _FINGERPRINT_BYTES]
    if named != fingerprint.encode().ljust(_FINGERPRINT_BYTES)[:_FINGERPRINT_BYTES]:
        raise ValueError("the entry is another program's")
    payload = entry[head:]
    if hashlib.sha256(payload).digest() != entry[head - _DIGEST_BYTES:head]:
        raise ValueError("the entry's bytes are damaged or cut short")
    return payload
