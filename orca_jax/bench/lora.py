"""`python -m orca_jax.bench lora`: multi-LoRA serving against the base model, in one run on one device.

- ops: one layer's adapter terms on every projection (max_loras slots of max_lora_rank, tokens spread
  over all slots) in the candidate forms (lora/ops.py), each over the layer's base projections at the
  same token count: the masked dense form the forward uses above SMALL_BATCH_TOKENS (also per
  projection), a gather of each token's weights, jax.lax.ragged_dot over tokens sorted by slot, and up
  to KERNEL_MAX_TOKENS tokens the BGMV kernels (kernels/lora_bgmv.py; interpreted off GPU), timed with
  the add into the base outputs. One layer per call: at a few tokens the call's dispatch dominates,
  which benchmarks/probes/lora_decode_profile.py avoids with a 32-layer stack;
- engine: one engine with `num_adapters` random adapters of `rank` on all seven projections (in as
  many slots) on the ORCA trace (all requests at once, EOS ignored): the base model alone, requests
  spread over every adapter, all on one adapter; then batch-1 decode (context ~512) on the base and
  on an adapter. Each trace runs twice; the second (warm) run is the one compared.
Writes --result-dir/<model>_lora.json and prints the ratios against the issue's targets (throughput >= 0.8x
the base's, batch-1 decode <= 1.2x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.bench.datasets import DatasetName, Trace, add_dataset_arguments, lengths_from_args, make_trace
from orca_jax.bench.harness import Results, add_engine_arguments, add_result_arguments, build_engine, random_model
from orca_jax.bench.roofline import time_call
from orca_jax.config import LoRAConfig, ModelConfig, ModelFamily
from orca_jax.engine import Engine
from orca_jax.lora import LoRARequest, ops
from orca_jax.lora.adapter import projection_shapes, random_adapter
from orca_jax.lora.layout import layer_shapes, nest
from orca_jax.sampling_params import SamplingParams

KERNEL_MAX_TOKENS = 32  # the ops section times the kernels up to this many tokens
THROUGHPUT_TARGET = 0.8  # adapters' tokens/s over the base's, at least
DECODE_TARGET = 1.2  # batch-1 decode time with an adapter over the base's, at most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM,))
    parser.add_argument("--num-adapters", type=int, default=16, help="random adapters, one device slot each")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", default="1,8,32,128,512,2048", help="token counts of the ops section")
    parser.add_argument("--sections", default="ops,engine")
    add_result_arguments(parser)


def run(args: argparse.Namespace) -> Results:
    results = Results("lora", args, args.model)
    results.section("setup", {"num_adapters": args.num_adapters, "rank": args.rank})
    sections = set(args.sections.split(","))
    config = random_model(args.model, args.dtype or "bfloat16").config
    if "ops" in sections:
        rows = time_layer_terms(config, args.num_adapters, args.rank, [int(x) for x in args.tokens.split(",")])
        results.section("ops", rows)
        for row in rows:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if "engine" in sections:
        engine = build_engine(args, lora=LoRAConfig(max_loras=args.num_adapters, max_lora_rank=args.rank))
        trace = make_trace(DatasetName.UNIFORM, args.num_prompts, None, args.seed, lengths_from_args(args))
        results.section("engine", run_engine(engine, trace, args.num_adapters, args.rank))
        print(json.dumps(results["engine"]["summary"], indent=1), flush=True)
    return results


# ---- ops ------------------------------------------------------------------------------------------

def time_layer_terms(config: ModelConfig, num_slots: int, rank: int, token_counts, seed: int = 0) -> list[dict]:
    """One layer of `config` (a Llama-family model): its base projections and the adapter terms in each
    candidate form, per token count, the tokens spread evenly over `num_slots` adapters (sorted by
    slot, as ragged_dot needs). Each form gets the weight layout it reads best."""
    if config.family is not ModelFamily.LLAMA:
        raise ValueError("the ops section times Llama-family layers (q|k|v, o, gate|up, down)")
    dtype = jnp.dtype(config.dtype)
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.02):  # drawn on the host: a jax draw per shape would compile a program each
        return jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(dtype))

    h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_size
    base = {"qkv": rand(h, k, n // k + 2, d), "o": rand(n, d, h), "gate_up": rand(h, 2, f), "down": rand(f, h)}
    table = nest({path: rand(*shape) for path, shape in layer_shapes(config, num_slots, rank).items()})
    # Per projection, flat [in, out], for the forms that take one projection at a time.
    flat = {p: (int(np.prod(i)), int(np.prod(o))) for p, (i, o) in projection_shapes(config).items()}
    slot_major = {p: (rand(num_slots, i, rank), rand(num_slots, rank, o)) for p, (i, o) in flat.items()}
    in_major = {p: (rand(i, num_slots, rank), slot_major[p][1]) for p, (i, _) in flat.items()}  # A: [in, M, R]

    @jax.jit
    def base_fn(x, attn_out, act, w):
        return (jnp.einsum("TH,HKGD->TKGD", x, w["qkv"]), jnp.einsum("TND,NDH->TH", attn_out, w["o"]),
                jnp.einsum("TH,HCF->TCF", x, w["gate_up"]), jnp.einsum("TF,FH->TH", act, w["down"]))

    @jax.jit
    def dense_fn(x, attn_out, act, table, slots):
        tokens = ops.LoRATokens.of(slots, num_slots, x.dtype)
        return (ops.qkv_delta(x, table["attn"]["qkv"], tokens), ops.o_delta(attn_out, table["attn"]["o"], tokens),
                ops.gate_up_delta(x, table["mlp"]["gate_up"], tokens), ops.in_delta(act, table["mlp"]["down"], tokens))

    small = ops.SmallBatchForm.KERNEL if jax.devices()[0].platform == "gpu" else ops.SmallBatchForm.KERNEL_INTERPRET

    @jax.jit
    def kernel_fn(x, attn_out, act, table, slots, outs):
        tokens = ops.LoRATokens(ops.LoRATokens.of(slots, num_slots, x.dtype).mask, jnp.maximum(slots - 1, 0), small)
        q, o, gate_up, down = outs
        return (ops.add_qkv(q, x, table["attn"]["qkv"], tokens), ops.add_o(o, attn_out, table["attn"]["o"], tokens),
                ops.add_gate_up(gate_up, x, table["mlp"]["gate_up"], tokens),
                ops.add_in(down, act, table["mlp"]["down"], tokens))

    def each(form):
        @jax.jit
        def fn(inputs, weights, slots_or_sizes):
            return [form(inputs[p], a, b, slots_or_sizes) for p, (a, b) in weights.items()]
        return fn

    forms = {"dense_per_projection": (each(ops.dense_delta), in_major, "slots"),
             "gather": (each(ops.gather_delta), slot_major, "slots"),
             "ragged_dot": (each(ops.ragged_dot_delta), slot_major, "group_sizes")}
    rows = []
    for tokens in token_counts:
        x, attn_out, act = rand(tokens, h, scale=1), rand(tokens, n, d, scale=1), rand(tokens, f, scale=1)
        slot_ids = np.repeat(np.arange(1, num_slots + 1), -(-tokens // num_slots))[:tokens]
        slots = jnp.asarray(slot_ids, jnp.int32)
        routing = {"slots": slots, "group_sizes": jnp.asarray(np.bincount(slot_ids, minlength=num_slots + 1)[1:], jnp.int32)}
        inputs = {p: {"o": attn_out.reshape(tokens, -1), "down": act}.get(p, x) for p in flat}
        base_s = time_call(base_fn, x, attn_out, act, base)
        row = {"tokens": tokens, "adapters_used": int(min(tokens, num_slots)), "base_ms": 1e3 * base_s}
        timed = [("dense", dense_fn, (x, attn_out, act, table, slots))]
        if tokens <= KERNEL_MAX_TOKENS:
            timed.append(("kernel", kernel_fn, (x, attn_out, act, table, slots, base_fn(x, attn_out, act, base))))
        timed += [(name, fn, (inputs, weights, routing[by])) for name, (fn, weights, by) in forms.items()]
        for name, fn, args in timed:
            try:
                seconds = time_call(fn, *args)
                row[f"{name}_ms"], row[f"{name}_over_base"] = 1e3 * seconds, seconds / base_s
            except Exception as error:  # one form failing to compile must not lose the others
                row[f"{name}_error"] = repr(error)[:300]
        rows.append(row)
    return rows


# ---- engine ---------------------------------------------------------------------------------------

def run_engine(engine: Engine, trace: Trace, num_adapters: int, rank: int) -> dict:
    started = time.perf_counter()
    loras = []
    for i in range(num_adapters):
        lora = LoRARequest(f"random-{i}", i + 1, "(random)")
        engine.add_lora(lora, random_adapter(engine.model_config, rank, seed=i, name=lora.lora_name))
        loras.append(lora)
    section: dict = {"adapters_made_s": time.perf_counter() - started,
                     "num_programs": engine.runner.compilation.num_compiled_programs,
                     "lora_table_bytes": sum(stage.lora.nbytes for stage in engine.runner.stages)}
    spreads = {"base": lambda i: None, "adapters": lambda i: loras[i % len(loras)], "one_adapter": lambda i: loras[0]}
    for label, pick in spreads.items():
        section[label] = [run_trace(engine, trace, pick) for _ in range(2)]
    section["decode_base"] = decode_ms(engine, None)
    section["decode_adapter"] = decode_ms(engine, loras[0])
    section["num_programs_after"] = engine.runner.compilation.num_compiled_programs
    section["num_loads"] = engine.lora.num_loads
    base = section["base"][-1]["tokens_per_s"]
    summary = {"base_tokens_per_s": base,
               "adapters_over_base": section["adapters"][-1]["tokens_per_s"] / base,
               "one_adapter_over_base": section["one_adapter"][-1]["tokens_per_s"] / base,
               "decode_adapter_over_base": section["decode_adapter"]["ms_per_iteration"]
               / section["decode_base"]["ms_per_iteration"]}
    summary["throughput_target_met"] = min(summary["adapters_over_base"], summary["one_adapter_over_base"]) >= THROUGHPUT_TARGET
    summary["decode_target_met"] = summary["decode_adapter_over_base"] <= DECODE_TARGET
    summary["compiled_while_serving"] = section["num_programs_after"] - section["num_programs"]
    section["summary"] = summary
    return section


def run_trace(engine: Engine, trace: Trace, pick) -> dict:
    """All of the trace's requests at once (request i with adapter pick(i)); generated tokens/s. The
    prefix cache starts empty: the same prompts ran before (under another adapter, or none)."""
    vocab = engine.model_config.vocab_size
    engine.reset_prefix_cache()
    start = time.perf_counter()
    for i, r in enumerate(trace.requests):
        engine.add_request(trace.prompt_ids(i, vocab), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                           lora_request=pick(i))
    generated = iterations = 0
    while engine.has_unfinished():
        generated += sum(len(out.new_token_ids) for out in engine.step())
        iterations += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "iterations": iterations}


def decode_ms(engine: Engine, lora: LoRARequest | None, context: int = 512, steps: int = 20) -> dict:
    """Median wall time of an iteration where one request (with `lora`) feeds one token."""
    context = min(context, engine.max_model_len - steps - 8)
    prompt = np.random.default_rng(1).integers(3, engine.model_config.vocab_size, context).tolist()
    engine.reset_prefix_cache()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True), lora_request=lora)
    while not any(out.request_id == request_id for out in engine.step()):
        pass  # the prompt is in and the first token out
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return {"context": context, "ms_per_iteration": 1e3 * statistics.median(times)}


def tables(result: dict) -> dict[str, list[dict]]:
    out = {}
    if "ops" in result:
        out["one layer's terms"] = result["ops"]
    engine = result.get("engine")
    if engine:
        runs = [{"run": name, "tokens/s": engine[name][-1]["tokens_per_s"], "s": engine[name][-1]["seconds"],
                 "iterations": engine[name][-1]["iterations"]} for name in ("base", "adapters", "one_adapter")
                if name in engine]
        runs += [{"run": name, "ms/iteration": engine[name]["ms_per_iteration"]}
                 for name in ("decode_base", "decode_adapter") if name in engine]
        out["engine"] = runs
        out["summary"] = [engine["summary"]]
    return out
