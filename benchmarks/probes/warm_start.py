"""Where a warm start's time goes: imports, jax backend, engine build (cProfile of the main thread with
PROFILE=1), and loading every program from the executable cache with N precompile threads.

`python benchmarks/probes/warm_start.py CACHE_DIR N` (N = 0: the runner's default, one per core) after
`python -m orca_jax.bench core-start --model llama-8b --cache-dir CACHE_DIR` filled the cache; MODEL
picks another preset.
"""
import time
t0 = time.perf_counter()
import cProfile, io, json, os, pstats, sys
import jax
t_jax = time.perf_counter()
jax.devices()
t_dev = time.perf_counter()
from orca_jax.bench.core import CoreSetup, engine_config, random_model
from orca_jax.engine import Engine
t_orca = time.perf_counter()
model = os.environ.get("MODEL", "llama-8b")
setup = CoreSetup(model=model)
prof = cProfile.Profile()
prof.enable()
engine = Engine(engine_config(setup, compilation_cache_dir=sys.argv[1], precompile=False), random_model(model, "bfloat16"))
prof.disable()
t_built = time.perf_counter()
threads = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "0" else None
report = engine.runner.precompile(engine.program_keys(), threads=threads)
t_done = time.perf_counter()
print(json.dumps({"threads": threads, "import_jax": t_jax - t0, "backend": t_dev - t_jax, "import_orca": t_orca - t_dev,
                  "build": t_built - t_orca, "loads": report.compile_seconds, "first_runs": report.warm_seconds,
                  "total_in_process": t_done - t0, "hits": engine.runner.executable_cache.hits if hasattr(engine.runner.executable_cache, "hits") else None}))
if os.environ.get("PROFILE"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    print("\n".join(l[:180] for l in s.getvalue().splitlines() if l.strip()))
