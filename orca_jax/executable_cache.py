"""Compiled programs kept on disk and loaded without tracing: what makes a warm start fast.

JAX's persistent compilation cache skips XLA's compile, but it still traces and lowers each program
to find the cache key. For llama-8b on an H100 that is most of a warm start (46 programs in 40 s),
and tracing holds the GIL, so the runner's compile threads cannot overlap it. This cache keys each
serialized executable by what its trace depends on, all known before tracing: the program's
identity as the runner describes it (program key, model config, attention kernel, meshes), the
shapes, dtypes and shardings of its inputs, the orca_jax source, jax's version and the devices. A
hit is deserialized; a miss is lowered and compiled as usual (through jax's cache) and stored.

Only for one controller process: an executable of several processes is theirs together.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every .py file of the package: any code change starts a fresh set of programs."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE_DIR):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, _PACKAGE_DIR).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def describe_arrays(tree) -> list[tuple]:
    """(path, shape, dtype, sharding spec, device ids) of every array leaf: a program's inputs."""
    def one(path, x):
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        devices = sorted(d.id for d in sharding.device_set) if sharding is not None else None
        return (jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), str(spec), devices)
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map_with_path(one, tree),
                                     is_leaf=lambda leaf: isinstance(leaf, tuple))


DEFAULT_MAX_BYTES = 4 * 2**30  # a few models' programs; every code change starts a new set


class ExecutableCache:
    """Serialized executables in `directory`, one file per fingerprint, the least recently used
    removed once they pass max_bytes together (each source change makes a new set: without a cap a
    developer's cache would only grow)."""

    def __init__(self, directory: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = directory
        self.max_bytes = max_bytes
        os.makedirs(directory, exist_ok=True)
        self.hits = self.misses = 0

    @staticmethod
    def fingerprint(identity) -> str:
        """A file name for the program `identity` describes (any repr-able, deterministic value)."""
        device = jax.devices()[0]
        context = (source_digest(), jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                   device.client.platform_version, jax.device_count(), os.environ.get("XLA_FLAGS"),
                   # the settings that change what a trace computes
                   jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64,
                   jax.config.jax_numpy_dtype_promotion)
        return hashlib.sha256(repr((context, identity)).encode()).hexdigest()

    def _path(self, fingerprint: str) -> str:
        return os.path.join(self.directory, f"{fingerprint}.bin")

    def load(self, fingerprint: str, devices: list[jax.Device]) -> jax.stages.Compiled | None:
        """The stored executable, loaded onto `devices` (its mesh's, in mesh order: the fingerprint
        must cover their ids), or None (absent, or unreadable by this jax: then removed)."""
        path = self._path(fingerprint)
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                 backend=devices[0].client,
                                                                 execution_devices=devices)
        except FileNotFoundError:
            self.misses += 1
            return None
        except Exception as error:  # noqa: BLE001 - a bad entry costs a compile, never a failure
            log.warning("dropping unreadable cached executable %s: %r", path, error)
            self.misses += 1
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        self.hits += 1
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return compiled

    def store(self, fingerprint: str, compiled: jax.stages.Compiled) -> None:
        """Write atomically (a reader never sees half a file); programs that cannot be serialized
        are skipped with a debug line."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as error:  # noqa: BLE001 - not every executable serializes
            log.debug("not caching an executable that cannot be serialized: %r", error)
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(fingerprint))
        except OSError as error:
            log.warning("could not store a cached executable in %s: %r", self.directory, error)
            if os.path.exists(tmp):
                os.remove(tmp)
            return
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used entries until the rest fit in max_bytes."""
        entries = []
        for name in os.listdir(self.directory):
            if name.endswith(".bin"):
                try:
                    info = os.stat(os.path.join(self.directory, name))
                except FileNotFoundError:
                    continue  # another process evicted it
                entries.append((info.st_mtime, info.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.remove(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
            total -= size
