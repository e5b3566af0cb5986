"""Full garbage collections during the in-process uniform trace, with the heap frozen and not.

`python benchmarks/probes/gc_in_process.py MODEL` on a GPU machine: five runs of the trace on one engine
(plain, plain, frozen, frozen, unfrozen), each with its tokens/s and its generation-2 collections.
"""
import gc, json, sys, time, os
from orca_jax.bench.core import CoreSetup, engine_config, random_model, _run_trace
from orca_jax.bench.traces import TraceKind, make_trace
from orca_jax.engine import Engine
model = sys.argv[1]
setup = CoreSetup(model=model)
engine = Engine(engine_config(setup, compilation_cache_dir="/tmp/gcc"), random_model(model, "bfloat16"))
trace = make_trace(TraceKind.UNIFORM, 512, None, 0, setup.lengths)
pauses = []
start = [0.0]
def cb(phase, info):
    if phase == "start": start[0] = time.perf_counter()
    elif info["generation"] == 2: pauses.append(time.perf_counter() - start[0])
gc.callbacks.append(cb)
out = {}
for label in ("plain", "plain", "frozen", "frozen", "plain_again"):
    if label == "frozen" and not gc.get_freeze_count():
        gc.collect(); gc.freeze()
    if label == "plain_again":
        gc.unfreeze()
    pauses.clear()
    r = _run_trace(engine, trace)
    out.setdefault(label, []).append({"tok_s": round(r["tokens_per_s"]), "gen2": len(pauses), "gen2_s": round(sum(pauses), 3)})
    print(label, out[label][-1], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"gc_inproc_{model}.json"), "w"))
