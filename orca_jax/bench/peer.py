"""`bench peer`: Hugging Face transformers' continuous batching (paged KV cache) on the same trace.

The model's shapes with random weights (bf16 on a GPU, fp32 on the CPU), greedy, EOS disabled (every
request generates exactly its max_new_tokens), all requests at once: generated tokens per second, and
the same batch-of-identical-requests latency as `bench latency` (--batch-size, --input-len,
--output-len). Run it in its own process: it never starts jax, so torch has the whole GPU. It uses the
manager API (`init_continuous_batching`, `add_request(..., max_new_tokens=)`, `get_result`) because
`generate_batch` takes one max_new_tokens for all requests, and the trace's differ.

  python -m orca_jax.bench peer --model llama-8b --result-dir DIR
"""

from __future__ import annotations

import argparse
import time

from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, identical_trace, int_list, lengths_from_args, make_trace
from orca_jax.bench.harness import Results, add_result_arguments
from orca_jax.config import ModelConfig, ModelFamily


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-8b", help="a preset")
    parser.add_argument("--device", default="cuda", help="torch's device")
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM, DatasetName.HOMOGENEOUS,
                                                      DatasetName.SHAREGPT_LIKE))
    parser.add_argument("--batch-size", type=int_list, default=[], help="also time batches of identical requests")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="of one run")
    add_result_arguments(parser)


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

    def __init__(self, model, max_prompt: int, max_gen: int, num_requests: int, cb_options: dict | None = None):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
        generation = GenerationConfig(max_new_tokens=max_gen, do_sample=False, eos_token_id=None, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=max_prompt, max_generated_length=max_gen,
                              num_requests=num_requests)
        start = time.perf_counter()
        self.manager = model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**(cb_options or {})),
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


def run(args: argparse.Namespace) -> Results:
    import torch
    import transformers

    from orca_jax.models.presets import get_preset

    device = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "platform": f"torch {torch.__version__}", "transformers": transformers.__version__}
    results = Results("peer", args, args.model, device=device)
    config = get_preset(args.model)
    trace = make_trace(args.dataset_name, args.num_prompts, None, args.seed, lengths_from_args(args))
    start = time.perf_counter()
    model = build_model(config, args.device)
    results.section("model_init_s", time.perf_counter() - start)
    prompts = [trace.prompt_ids(i, config.vocab_size) for i in range(len(trace))]
    gens = [r.max_tokens for r in trace.requests]
    # Off the GPU, transformers would size its KV cache from 90 % of the host's memory: give it the trace's.
    cb_options = {} if args.device == "cuda" else {"num_blocks": 1 + len(prompts) * (max(map(len, prompts)) + max(gens)) // 256,
                                                   "max_batch_tokens": 512}
    runner = HFRunner(model, max(len(p) for p in prompts), max(max(gens), args.output_len), len(prompts), cb_options)
    results.section("setup", {"setup_s": runner.setup_s, "cb_config": runner.resolved,
                              "attn_implementation": runner.attn_implementation})
    try:
        runner.run(prompts[:8], [min(g, 8) for g in gens[:8]], args.timeout_s)  # warm-up
        offline = runner.run(prompts, gens, args.timeout_s)
        offline |= {"tokens_per_s": offline["generated_tokens"] / offline["seconds"],
                    "requests_per_s": len(prompts) / offline["seconds"], "dataset": trace.describe()}
        results.section("offline", offline)
        print(f"transformers continuous batching, {args.model}: {offline['tokens_per_s']:,.0f} tok/s", flush=True)
        rows = []
        for batch_size in args.batch_size:
            batch = identical_trace(batch_size, args.input_len, args.output_len)
            measured = runner.run([batch.prompt_ids(i, config.vocab_size) for i in range(batch_size)],
                                  [args.output_len] * batch_size, args.timeout_s)
            rows.append({"batch_size": batch_size, "input_len": args.input_len, "output_len": args.output_len,
                         "batch_latency_s": measured["seconds"], "generated_tokens": measured["generated_tokens"]})
            results.section("latency", rows)
    finally:
        runner.close()
    return results


def tables(result: dict) -> dict[str, list[dict]]:
    offline = result.get("offline") or {}
    rows = [{"run": "offline", "requests": (offline.get("dataset") or {}).get("num_requests"),
             "tok/s": offline.get("tokens_per_s"), "wrong lengths": offline.get("requests_with_wrong_length")}]
    rows += [{"run": f"batch {r['batch_size']} x {r['input_len']}+{r['output_len']}", "requests": r["batch_size"],
              "latency s": r["batch_latency_s"]} for r in result.get("latency", [])]
    return {"transformers continuous batching": rows if offline or result.get("latency") else []}
