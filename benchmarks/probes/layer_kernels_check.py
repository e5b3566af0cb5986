"""Probe: on a GPU, the serving forward with the layer kernels (AttentionBackend.PALLAS) against XLA's ops
around the same attention kernel (PALLAS_ATTENTION) and the jnp path (JNP), same random weights.

Per backend: one prompt's logits at every position, and greedy tokens of 8 requests. In float32 (matmuls
at highest precision) the tokens must agree exactly; in bfloat16 (and with FP8 KV pages) the report gives
the logits' largest difference against the logits' spread.

    python benchmarks/probes/layer_kernels_check.py --model llama-1b --dtype float32 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from orca_jax.bench.harness import random_model
from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, KVCacheDtype, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams
from tests.helpers.engines import drain
from tests.helpers.models import prompt_logits



def run(model: str, dtype: str, backend: AttentionBackend, kv_cache_dtype: str) -> tuple[np.ndarray, list]:
    config = EngineConfig(model=model, dtype=dtype, precompile=False, compilation_cache_dir=None, seed=3,
                          attention=backend, kv_cache_dtype=KVCacheDtype(kv_cache_dtype),
                          cache=CacheConfig(enable_prefix_caching=False, kv_memory_gib=2.0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    loaded = random_model(model, dtype)
    engine = Engine(config, loaded)
    top = min(5000, loaded.config.vocab_size - 1)
    prompts = [[1 + (7 * i + 13 * j) % top for j in range(16 + 9 * i)] for i in range(8)]
    logits = prompt_logits(engine.runner, prompts[3])  # f32[T, V]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True), request_id=str(i))
    tokens = drain(engine)
    del engine  # its pages and weights go before the next backend's
    return logits, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    results = {b: run(args.model, args.dtype, b, args.kv_cache_dtype)
               for b in (AttentionBackend.PALLAS, AttentionBackend.PALLAS_ATTENTION, AttentionBackend.JNP)}
    base_logits, base_tokens = results[AttentionBackend.PALLAS_ATTENTION]
    report = {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
              "device": jax.devices()[0].device_kind, "commit": os.environ.get("ORCA_JAX_COMMIT"),
              "logits_std": float(base_logits.std())}
    for backend, (logits, tokens) in results.items():
        report[backend.value] = {
            "max_abs_logit_diff_vs_pallas_attention": float(np.abs(logits - base_logits).max()),
            "argmax_agree": float((logits.argmax(-1) == base_logits.argmax(-1)).mean()),
            "requests_with_equal_tokens": sum(tokens[k] == base_tokens[k] for k in base_tokens),
            "requests": len(base_tokens)}
    name = f"layer_kernels_check_{args.model}_{args.dtype}_kv{args.kv_cache_dtype}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
