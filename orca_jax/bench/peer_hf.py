"""The peer engine: Hugging Face transformers' continuous batching (paged KV cache) on the same trace.

Same model shapes as our preset with random weights in bf16, greedy, EOS disabled (eos -1, so every
request generates exactly its max_new_tokens). Run it in its own process (`python -m orca_jax.bench
hf ...`), before JAX takes the GPU, so each framework gets the whole device. Uses the manager API
(`init_continuous_batching`, `add_request(..., max_new_tokens=)`, `get_result`) because
`generate_batch` takes a single max_new_tokens for all requests, and the trace's differ.
"""

from __future__ import annotations

import json
import time

from orca_jax.bench.traces import Trace, identical_trace
from orca_jax.config import ModelConfig, ModelFamily


def hf_config(config: ModelConfig):
    """A transformers config with the preset's shapes."""
    if config.family is ModelFamily.LLAMA:
        from transformers import LlamaConfig
        return LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
            max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            tie_word_embeddings=config.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    from transformers import GPT2Config
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_size,
        activation_function="gelu_new", layer_norm_epsilon=config.norm_eps, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)


def build_model(config: ModelConfig, device: str):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class HFRunner:
    """One continuous-batching manager, reused for every measurement on one model."""

    def __init__(self, model, max_prompt: int, max_gen: int, num_requests: int):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
        generation = GenerationConfig(max_new_tokens=max_gen, do_sample=False, eos_token_id=None, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=max_prompt, max_generated_length=max_gen,
                              num_requests=num_requests)
        start = time.perf_counter()
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(),
            workload_hints=hints)
        self.manager.warmup()
        self.manager.start()
        self.setup_s = time.perf_counter() - start
        self.resolved = {k: repr(v) for k, v in vars(self.manager.continuous_batching_config).items()}
        self.attn_implementation = model.config._attn_implementation
        self._ids = 0

    def run(self, prompts: list[list[int]], max_tokens: list[int], timeout_s: float = 300.0) -> dict:
        """All requests at once; seconds until the last finishes, and checks on the outputs."""
        manager = self.manager
        start = time.perf_counter()
        expected = {}
        for ids, n in zip(prompts, max_tokens):
            rid = f"r{self._ids}"
            self._ids += 1
            manager.add_request(ids, request_id=rid, max_new_tokens=n, eos_token_id=-1)
            expected[rid] = n
        lengths, errors = {}, []
        while len(lengths) < len(expected):
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{len(lengths)} of {len(expected)} finished after {timeout_s}s")
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped")
                continue
            if result.is_finished() and result.request_id in expected:
                lengths[result.request_id] = len(result.generated_tokens)
                if result.error is not None:
                    errors.append(str(result.error))
        seconds = time.perf_counter() - start
        short = sum(lengths[r] != n for r, n in expected.items())
        return {"seconds": seconds, "generated_tokens": sum(lengths.values()),
                "requests_with_wrong_length": short, "errors": errors[:3]}

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)


def run_peer(config: ModelConfig, trace: Trace, *, device: str = "cuda", micro_batch_sizes=(1, 8, 32, 128),
             micro_input_lens=(32, 128), out_path: str | None = None) -> dict:
    """Offline throughput on the trace (all requests at time 0) and the Fig. 9 microbenchmark."""
    import torch
    import transformers
    result = {"engine": "transformers continuous batching", "transformers": transformers.__version__,
              "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "trace": trace.describe()}

    def save():
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)

    start = time.perf_counter()
    model = build_model(config, device)
    result["model_init_s"] = time.perf_counter() - start
    prompts = [trace.prompt_ids(i, config.vocab_size) for i in range(len(trace))]
    gens = [r.max_tokens for r in trace.requests]
    param = next(model.parameters())
    result["param_device_dtype"] = f"{param.device} {param.dtype}"
    result["plain_generate_bs1"] = _plain_generate(model, prompts[0][:128], 32)
    save()
    runner = HFRunner(model, max(len(p) for p in prompts), max(max(gens), 32), len(prompts))
    result.update(setup_s=runner.setup_s, cb_config=runner.resolved, attn_implementation=runner.attn_implementation)
    save()
    try:
        runner.run(prompts[:8], [min(g, 8) for g in gens[:8]])  # warm-up
        offline = runner.run(prompts, gens)
        offline["tokens_per_s"] = offline["generated_tokens"] / offline["seconds"]
        offline["requests_per_s"] = len(prompts) / offline["seconds"]
        result["offline"] = offline
        save()
        micro = []
        for input_len in micro_input_lens:
            for bs in micro_batch_sizes:
                batch = identical_trace(bs, input_len, 32)
                row = runner.run([batch.prompt_ids(i, config.vocab_size) for i in range(bs)], [32] * bs)
                micro.append({"input_len": input_len, "batch_size": bs, "max_tokens": 32,
                              "batch_seconds": row["seconds"], "generated_tokens": row["generated_tokens"]})
                result["microbench"] = micro
                save()
    finally:
        runner.close()
    return result


def _plain_generate(model, prompt: list[int], max_tokens: int) -> dict:
    """A sanity point outside continuous batching: model.generate, batch 1, greedy, dynamic cache."""
    import torch
    ids = torch.tensor([prompt], device=model.device)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **kwargs)  # warm-up
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": int(out.shape[1] - len(prompt)),
            "ms_per_token": 1e3 * seconds / max_tokens}
