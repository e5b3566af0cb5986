"""Test-session setup: compile each XLA program once per CI run, however many engines build it.

Every Engine owns its own jitted functions, so two tests with the same tiny model and bucket would
otherwise compile the same program twice; jax's persistent compilation cache makes the second a
disk read. The cache lives in a per-session temporary directory, so runs stay independent.
"""

import atexit
import os
import shutil
import tempfile

# On a GPU machine the suite's processes share the device (a server or CLI started beside the engines
# this process holds): each allocates as it needs instead of taking 75% of the memory at start, which
# left a served child too little to start. Set before jax's first use of a device; children inherit it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

# The suite's fp32 comparisons with transformers, peft and numpy references assume f32 matmuls in f32,
# as XLA:CPU computes them; on a GPU XLA's default runs them in TF32 (10-bit mantissas), which alone
# moved llama's logits past those tolerances on an H100. bf16 programs are unaffected.
jax.config.update("jax_default_matmul_precision", "highest")

_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": tempfile.mkdtemp(prefix="orca_jax_xla_cache_"),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
atexit.register(shutil.rmtree, _CACHE_SETTINGS["jax_compilation_cache_dir"], ignore_errors=True)
for _name, _value in _CACHE_SETTINGS.items():
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)  # subprocesses (server, notebook kernel) share the cache
