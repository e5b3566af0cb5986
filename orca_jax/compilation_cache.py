"""JAX's persistent compilation cache, on by default in a per-user directory.

A cold start compiles one forward program per token bucket and a few sampling programs; with the
cache on, a second start of the same model and config reads them from disk instead. jax reads the
setting when it first compiles, so this runs before the engine builds anything.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

AUTO = "auto"  # EngineConfig.compilation_cache_dir: jax's own setting if any, else default_cache_dir()


def default_cache_dir() -> str:
    """$ORCA_JAX_CACHE_DIR, else $XDG_CACHE_HOME/orca_jax/xla, else ~/.cache/orca_jax/xla."""
    if os.environ.get("ORCA_JAX_CACHE_DIR"):
        return os.environ["ORCA_JAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "orca_jax", "xla")


def configure_compilation_cache(directory: str | None) -> str | None:
    """Point jax's persistent cache at `directory` (AUTO: keep jax's if set); None turns it off.

    Returns the directory in use, or None when the cache is off.
    """
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if directory == AUTO:
        directory = jax.config.jax_compilation_cache_dir or default_cache_dir()
    if directory != jax.config.jax_compilation_cache_dir:
        os.makedirs(directory, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", directory)
        log.info("persistent compilation cache: %s", directory)
    # jax skips programs that compiled in under a second; a start compiles few programs, and the
    # quick ones (drawing random weights, allocating the KV pages) are paid again on every start.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory
