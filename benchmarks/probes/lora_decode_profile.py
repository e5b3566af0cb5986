"""Where batch-1 decode with an adapter spends its time: the GPU kernels of one decode step, base vs
adapter (jax's profiler, its perfetto trace read back), and a 32-layer stack of llama-8b's projections
at T = 8 tokens (the smallest bucket, one of them adapted) with each adapter-term form.

    PYTHONPATH=. python benchmarks/probes/lora_decode_profile.py OUT_DIR [FORMS]   (on an H100)
"""
import collections
import glob
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench import lora as bench_lora
from orca_jax.bench.__main__ import build_parser
from orca_jax.bench.harness import build_engine, random_model
from orca_jax.config import LoRAConfig
from orca_jax.lora import LoRARequest, ops
from orca_jax.lora.adapter import random_adapter
from orca_jax.lora.layout import layer_shapes, nest

OUT = sys.argv[1]
FORMS = (sys.argv[2] if len(sys.argv) > 2 else "base,gather,dense,kernel").split(",")
TOKENS = [int(t) for t in os.environ.get("PROBE_TOKENS", "8").split(",")]
ENGINE = os.environ.get("PROBE_ENGINE", "1") == "1"
M, R = 16, 16
MODEL = os.environ.get("PROBE_MODEL", "llama-8b")  # a small preset for a CPU try
LAYERS = int(os.environ.get("PROBE_LAYERS", "32"))
os.makedirs(OUT, exist_ok=True)


def kernels(trace_dir: str, steps: int) -> list[dict]:
    """GPU kernel events of the perfetto trace under trace_dir: name, count per step, us per step."""
    path = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e.get("pid"), "")]
    total = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        total[e["name"]][0] += 1
        total[e["name"]][1] += float(e.get("dur", 0))
    rows = [{"kernel": k[:90], "per_step": c / steps, "us_per_step": d / steps} for k, (c, d) in total.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profiled(label: str, step, steps: int = 10) -> dict:
    for _ in range(3):
        step()
    trace_dir = f"/tmp/trace_{label}"
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            step()
    try:
        rows = kernels(trace_dir, steps)
    except Exception as error:  # the trace may lack GPU events (no CUPTI): keep the timings
        return {"error": repr(error)[:300]}
    return {"kernels_per_step": sum(r["per_step"] for r in rows), "gpu_us_per_step": sum(r["us_per_step"] for r in rows),
            "top": rows[:60]}


results: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__}

# ---- a 32-layer stack of the projections, each form's adapter terms at T tokens (token 0 adapted) ----
config = random_model(MODEL).config
h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_size
key = jax.random.PRNGKey(0)


def rand(*shape):
    global key
    key, sub = jax.random.split(key)
    return (0.02 * jax.random.normal(sub, shape, jnp.float32)).astype(jnp.bfloat16)


base = [{"qkv": rand(h, k, n // k + 2, d), "o": rand(n, d, h), "gate_up": rand(h, 2, f), "down": rand(f, h)}
        for _ in range(LAYERS)]
tables = [nest({p: rand(*s) for p, s in layer_shapes(config, M, R).items()}) for _ in range(LAYERS)]


def tokens_of(form: str, slots):
    small = ops.SmallBatchForm.KERNEL if form == "kernel" else ops.SmallBatchForm.GATHER
    # The small buckets' forms at any T (the engine uses them up to SMALL_BATCH_TOKENS).
    t = ops.LoRATokens(ops.LoRATokens.of(slots, M, jnp.bfloat16).mask, jnp.maximum(slots - 1, 0), small)
    return t.without_rows() if form == "dense" else t


def make_stack(form: str):
    @jax.jit
    def stack(x, base, tables, slots):
        tokens = tokens_of(form, slots)
        for w, table in zip(base, tables):
            qkv = jnp.einsum("TH,HKGD->TKGD", x, w["qkv"])
            if form != "base":
                qkv = ops.add_qkv(qkv, x, table["attn"]["qkv"], tokens)
            attn = qkv[:, :, : n // k].reshape(x.shape[0], n, d)  # stands in for attention
            y = jnp.einsum("TND,NDH->TH", attn, w["o"])
            if form != "base":
                y = ops.add_o(y, attn, table["attn"]["o"], tokens)
            x = x + y
            gu = jnp.einsum("TH,HCF->TCF", x, w["gate_up"])
            if form != "base":
                gu = ops.add_gate_up(gu, x, table["mlp"]["gate_up"], tokens)
            act = jax.nn.silu(gu[:, 0]) * gu[:, 1]
            down = jnp.einsum("TF,FH->TH", act, w["down"])
            if form != "base":
                down = ops.add_in(down, act, table["mlp"]["down"], tokens)
            x = x + down
        return x
    return stack


stack_rows = {}
for t_count in TOKENS:
    x = rand(t_count, h)
    for spread in ("one", "all"):  # one adapted token (batch-1 decode), or every token on its own slot
        slot_ids = [3] + [0] * (t_count - 1) if spread == "one" else [1 + i % M for i in range(t_count)]
        if spread == "all" and t_count == 1:
            continue
        slots = jnp.asarray(slot_ids, jnp.int32)
        for form in FORMS:
            if form == "base" and spread == "all":
                continue
            fn = make_stack(form)
            jax.block_until_ready(fn(x, base, tables, slots))
            start = time.perf_counter()
            for _ in range(50):
                out = fn(x, base, tables, slots)
            jax.block_until_ready(out)
            row = {"ms": 1e3 * (time.perf_counter() - start) / 50}
            row |= profiled(f"stack_{form}_{t_count}_{spread}", lambda: jax.block_until_ready(fn(x, base, tables, slots)))
            stack_rows[f"T{t_count}_{spread}_{form}"] = row
            print(t_count, spread, form, {k: v for k, v in row.items() if k != "top"}, flush=True)
            json.dump(results | {"stack": stack_rows}, open(f"{OUT}/lora_decode_profile.json", "w"), indent=1)
results["stack"] = stack_rows
base = tables = None  # the stack measurements are done: free their weights
json.dump(results, open(f"{OUT}/lora_decode_profile.json", "w"), indent=1)

# ---- the engine: one decode step, base vs adapter ------------------------------------------------------
if not ENGINE:
    sys.exit(0)
args = build_parser().parse_args(["lora", "--model", MODEL, "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                  "--compilation-cache-dir", "/tmp/cc"])
engine = build_engine(args, lora=LoRAConfig(max_loras=M, max_lora_rank=R))
lora = LoRARequest("random-0", 1, "(random)")
engine.add_lora(lora, random_adapter(engine.model_config, R, seed=0, name=lora.lora_name))
engine_rows = {}
for label, req in (("base", None), ("adapter", lora)):
    engine_rows[label] = bench_lora.decode_ms(engine, req)
    prompt = np.random.default_rng(1).integers(3, engine.model_config.vocab_size, min(512, engine.max_model_len - 240)).tolist()
    engine.reset_prefix_cache()
    from orca_jax.sampling_params import SamplingParams
    rid = engine.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True), lora_request=req)
    while not any(o.request_id == rid for o in engine.step()):
        pass
    engine_rows[label] |= profiled(f"engine_{label}", engine.step)
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    print(label, {k: v for k, v in engine_rows[label].items() if k != "top"}, flush=True)
results["engine"] = engine_rows
json.dump(results, open(f"{OUT}/lora_decode_profile.json", "w"), indent=1)
