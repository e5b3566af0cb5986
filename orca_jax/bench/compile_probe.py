"""How long one forward program takes to trace, lower and compile, and what makes it long.

`python -m orca_jax.bench compile-probe --model llama-8b --layers 8 --tokens 160 [--attention jnp]`
builds one stage's forward program from shapes alone (no weights are made) and times its three
phases on one thread, with no compilation cache. Run it with a few layer counts and attention
backends, or with XLA_FLAGS set, to see which part of the cold start grows with what.

`--dispatch-runs N` then times N runs' host dispatch; `--fresh-inputs` feeds each a new numpy batch
through the engine's path (stage-in into a donated buffer, then the forward on it), and `--unstaged`
also times the forward fed those arrays directly, in the same process, for the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.batch import forward_inputs_size, next_power_of_two
from orca_jax.config import AttentionBackend
from orca_jax.models import decoder
from orca_jax.models.attention import LayerKV
from orca_jax.models.presets import get_preset
from orca_jax.pipeline import forward_program, stage_in_program
from orca_jax.runner import choose_attention, compiler_options_for


def probe(model: str, num_layers: int, tokens: int, seqs: int = 128, pages: int = 4096,
          attention: AttentionBackend = AttentionBackend.AUTO, page_size: int = 16,
          dispatch_runs: int = 0, fresh_inputs: bool = False, unstaged: bool = False) -> dict:
    """Seconds to trace, lower and compile the forward of one (T, S) bucket for `num_layers` layers;
    with dispatch_runs, then the host's time to dispatch it (the call returning, asynchronously) and
    the device's time per run, on zero weights and pages (every sequence empty)."""
    config = dataclasses.replace(get_preset(model), num_layers=num_layers)
    platform = jax.devices()[0].platform
    params = decoder.compute_param_shapes(config)
    dtype = jnp.dtype(config.dtype)
    page = jax.ShapeDtypeStruct((config.num_kv_heads, pages, page_size, config.head_dim), dtype)
    kv = tuple(LayerKV(page, page) for _ in range(num_layers))
    table_width = -(-config.max_seq_len // page_size)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    # S as the engine ties it to T (BucketPolicy.seqs_for); `seqs` is the batch size, the samples' width.
    bucket = (tokens, min(next_power_of_two(tokens), seqs), table_width)
    model_fn = decoder.Decoder(config, choose_attention(attention, platform))
    forward = forward_program()
    args = (params, kv, i32(forward_inputs_size(*bucket)), i32(seqs))
    start = time.perf_counter()
    traced = forward.trace(model_fn, True, True, bucket, *args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options_for(platform))
    compiled_at = time.perf_counter()
    result = {"model": model, "layers": num_layers, "tokens": tokens, "seqs": seqs, "attention": attention.value,
              "platform": platform, "trace_s": traced_at - start, "lower_s": lowered_at - traced_at,
              "compile_s": compiled_at - lowered_at}
    if dispatch_runs:
        result.update(dispatch_timing(compiled, args, dispatch_runs, fresh_inputs, unstaged))
        result["fresh_inputs"] = fresh_inputs
    return result


def dispatch_timing(compiled, shapes, runs: int, fresh_inputs: bool = False, unstaged: bool = False) -> dict:
    """Host ms per iteration (the calls returning) and device ms per run, back to back, on zeros.

    fresh_inputs: the packed batch inputs come from a new numpy array each iteration, as the engine's
    do, and go in as the engine's do (pipeline.Stage.run): a stage-in program copies them into a
    donated buffer, then the forward reads that. unstaged (with fresh_inputs): also time the forward
    fed the fresh arrays directly, as unstaged_dispatch_ms and unstaged_device_ms_per_run."""
    params, kv, packed, prev = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    host_packed = np.asarray(packed)
    direct = lambda kv, inputs: compiled(params, kv, inputs, prev)[1]  # the pages are donated: thread them
    kv = jax.block_until_ready(direct(kv, packed))  # first run: module load
    if not fresh_inputs:
        host_ms, device_ms, kv = _timed_runs(direct, kv, runs, lambda: packed)
        return {"dispatch_ms": host_ms, "device_ms_per_run": device_ms}
    stage_in = stage_in_program().lower(shapes[2], shapes[2]).compile()
    staged = jnp.zeros_like(packed)

    def engine_path(kv, inputs):
        nonlocal staged
        staged = stage_in(staged, inputs)  # donated: the buffer keeps its address
        return compiled(params, kv, staged, prev)[1]

    kv = jax.block_until_ready(engine_path(kv, host_packed.copy()))  # first run of the stage-in
    host_ms, device_ms, kv = _timed_runs(engine_path, kv, runs, host_packed.copy)
    result = {"dispatch_ms": host_ms, "device_ms_per_run": device_ms}
    if unstaged:
        host_ms, device_ms, kv = _timed_runs(direct, kv, runs, host_packed.copy)
        result.update(unstaged_dispatch_ms=host_ms, unstaged_device_ms_per_run=device_ms)
    return result


def _timed_runs(run, kv, runs: int, new_inputs) -> tuple[float, float, object]:
    """(median host ms per `run(kv, new_inputs())` call, device ms per run, the pages after)."""
    host = []
    start = time.perf_counter()
    for _ in range(runs):
        inputs = new_inputs()  # made outside the timed call: the engine packs them while the device runs
        began = time.perf_counter()
        kv = run(kv, inputs)
        host.append(time.perf_counter() - began)
    jax.block_until_ready(kv)
    device_ms = 1e3 * (time.perf_counter() - start) / runs
    return 1e3 * sorted(host)[len(host) // 2], device_ms, kv


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="bench compile-probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--attention", default="auto", choices=[b.value for b in AttentionBackend])
    parser.add_argument("--dispatch-runs", type=int, default=0,
                        help="then time this many runs on zeros (host dispatch vs device time)")
    parser.add_argument("--fresh-inputs", action="store_true",
                        help="new numpy batch inputs every run, staged into a donated buffer as the engine "
                             "does (stage-in, then the forward)")
    parser.add_argument("--unstaged", action="store_true",
                        help="with --fresh-inputs: also time the forward fed them directly (unstaged_dispatch_ms)")
    args = parser.parse_args(argv)
    if args.unstaged and not args.fresh_inputs:
        parser.error("--unstaged compares against --fresh-inputs: pass both")
    jax.config.update("jax_enable_compilation_cache", False)
    for layers in args.layers:
        print(json.dumps(probe(args.model, layers, args.tokens, args.seqs, attention=AttentionBackend(args.attention),
                               dispatch_runs=args.dispatch_runs, fresh_inputs=args.fresh_inputs,
                               unstaged=args.unstaged)), flush=True)


if __name__ == "__main__":
    main()
