"""The engine issue's numbers on CPU: SmolLM2-135M (real weights, fp32), mixed requests batched vs one
at a time, and host vs device time per iteration."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time

from orca_jax.bench import driver, warmup
from orca_jax.bench.traces import LengthSpec, TraceKind, make_trace
from orca_jax.config import AttentionBackend


def run_cpu(out_dir: str, model: str = "smollm2-135m", num_requests: int = 64, alone: int = 8,
            prompt_range=(16, 64), gen: int = 16, seed: int = 0) -> dict:
    import jax
    lengths = LengthSpec(prompt_range=prompt_range, gen_range=(gen, gen))
    trace = make_trace(TraceKind.UNIFORM, num_requests, None, seed, lengths)
    engine = driver.build_engine(model, max_num_seqs=num_requests, max_num_batched_tokens=512, num_pages=1024,
                                 page_size=16, max_model_len=256, attention=AttentionBackend.JNP)
    compiled = warmup.precompile(engine, max_kv_tokens=prompt_range[1] + gen)
    driver.use_scheduler(engine, driver.ORCA, num_requests)
    mixed = driver.run_trace(engine, trace, "mixed", realtime=False).summary()
    subset = dataclasses.replace(trace, requests=trace.requests[:alone])
    one = driver.run_one_at_a_time(engine, subset, "one-at-a-time").summary()
    result = {
        "model": model, "weights": "real (GGUF Q4_1 dequantized to fp32)", "dtype": engine.model_config.dtype,
        "device": {"platform": "cpu", "processor": platform.processor() or platform.machine(),
                   "cores": os.cpu_count(), "jax": jax.__version__},
        "command": "python3 -m orca_jax.bench " + " ".join(sys.argv[1:]),
        "trace": trace.describe(), "one_at_a_time_subset": alone, "precompile": compiled,
        "mixed": mixed, "one_at_a_time": one,
        "speedup_tokens_per_s": mixed["throughput_tok_s"] / one["throughput_tok_s"],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "engine_issue.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(f"{model} on CPU: {mixed['throughput_tok_s']:.1f} tok/s batched ({num_requests} requests, mean batch "
          f"{mixed['mean_batch_size']:.1f}) vs {one['throughput_tok_s']:.1f} tok/s one at a time "
          f"(x{result['speedup_tokens_per_s']:.1f}); host {1e3 * mixed['host_s_per_iter']:.1f} ms/it, "
          f"device {1e3 * mixed['device_wait_s_per_iter']:.1f} ms/it")
    return result
