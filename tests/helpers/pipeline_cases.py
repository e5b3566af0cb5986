"""Run in a subprocess with 8 fake CPU devices by worker/test_pipeline.py: every (tp, pp) case of two tiny
models, printing one JSON line of tokens, in-flight counts, placements and compiled-program facts."""

from __future__ import annotations

import functools
import json
import re

import jax
import numpy as np

from orca_jax.config import CacheConfig, EngineConfig, ModelConfig, ModelFamily, ParallelConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.models import decoder
from orca_jax.models.loader import LoadedModel
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import ByteTokenizer
from orca_jax.worker.compilation import ForwardKey

from tests.helpers.engines import drain

# 4 layers (so 4 stages get one each) and odd vocabularies (padded to the tensor size, masked). The
# Llama has GQA with 2 KV heads (tensor parallel 4 replicates them) and an untied LM head; the GPT ties
# its embeddings (the table is on the first and the last stage).
MODELS = {
    "llama": ModelConfig(family=ModelFamily.LLAMA, vocab_size=255, hidden_size=64, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=8, ffn_size=128, max_seq_len=128, tie_embeddings=False),
    "gpt": ModelConfig(family=ModelFamily.GPT, vocab_size=257, hidden_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=4, head_dim=16, ffn_size=256, max_seq_len=128),
}
CASES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4)]  # (tensor parallel, stages)
PROMPTS = [[5, 6, 7], list(range(10, 22)), [99] * 9, list(range(50, 61)), [3] * 5, [7, 8], [200] * 12, [1]]
MAX_TOKENS = 4
SHARED = list(range(30, 39))
# Some requests process their logits (greedy still): penalties counted on the last stage's devices
# (slots filled from the prompt), a logit bias and an allowed-token mask; every mesh must agree.
LOGITS_PROCESSING = {2: dict(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.5),
                     4: dict(repetition_penalty=0.5, logit_bias={7: 0.5}),
                     6: dict(allowed_token_ids=list(range(100, 160)))}


@functools.cache
def host_params(model: str):
    """Random weights of `model` in the stacked (file) layout, made with numpy: compiling the on-device
    initialiser costs more than the rest of a case."""
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        noise = rng.standard_normal(shape.shape).astype(np.float32)
        return 1.0 + 0.1 * noise if "scale" in jax.tree_util.keystr(path) else 0.05 * noise
    return jax.tree_util.tree_map_with_path(leaf, decoder.stacked_param_shapes(MODELS[model]))


def engine_for(model: str, tp: int, pp: int, batches_in_flight: int | None = None,
               random_init: bool = False, prefix_caching: bool = True, async_scheduling: bool = False,
               **processes) -> Engine:
    """Weights placed from the host (one random init per model keeps the suite fast), or with
    random_init made on each stage's devices, which must give the same values."""
    # max_num_seqs 2 with 8 requests: enough disjoint batches to keep every stage busy. A budget of
    # 8 tokens and at most 16 per request keep every batch in one bucket: one program per stage.
    config = EngineConfig(model=model, cache=CacheConfig(page_size=4, num_pages=64,
                                                         enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                                    async_scheduling=async_scheduling),  # off: Algorithm 1
                          parallel=ParallelConfig(num_stages=pp, tensor_parallel=tp, **processes),
                          max_in_flight=batches_in_flight, precompile=False)
    params = None if random_init else host_params(model)
    return Engine(config, LoadedModel(MODELS[model], params, ByteTokenizer()))


def run(engine: Engine) -> dict:
    for i, prompt in enumerate(PROMPTS):
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **LOGITS_PROCESSING.get(i, {}))
        engine.add_request(prompt, sampling, request_id=str(i))
    tokens = drain(engine)
    stats = engine.stats()
    return {"tokens": tokens, "max_in_flight": stats.peak_in_flight,
            "mean_in_flight": stats.mean_in_flight, "pages_used": stats.kv_pages_used,
            "iterations": stats.iterations}


def run_one(engine: Engine) -> dict:
    """One request alone: no second batch can fill the pipeline."""
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3 * MAX_TOKENS, ignore_eos=True), request_id="1")
    tokens = drain(engine)
    stats = engine.stats()
    return {"tokens": tokens, "max_in_flight": stats.peak_in_flight, "iterations": stats.iterations}


def run_shared(engine: Engine) -> dict:
    """Two waves of requests sharing a 9-token prefix (two full pages): the second finds it cached."""
    tokens = {}
    for wave in range(2):
        for i, suffix in enumerate(([5], [6, 7], [8, 9, 10])):
            engine.add_request(SHARED + suffix + [wave], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                               request_id=f"{wave}/{i}")
        tokens.update(drain(engine))
    stats = engine.stats()
    return {"tokens": tokens, "hits": stats.prefix_cache_hits, "fed": stats.scheduled_tokens_total}


def devices_of(tree) -> list[list[int]]:
    """The sorted device ids of every leaf, deduplicated."""
    sets = {tuple(sorted(d.id for d in x.sharding.device_set)) for x in jax.tree_util.tree_leaves(tree)}
    return sorted(list(s) for s in sets)


def program_facts(engine: Engine) -> dict:
    """For each stage's forward program of the first bucket: collectives and per-device argument bytes,
    next to the bytes of the stage's own weight and KV shards (one device's) and, on the last, its
    logits buffer."""
    runner = engine.runner
    facts = {}
    bucket = min(k.bucket for k in runner.compilation.compiled_keys if isinstance(k, ForwardKey))
    for stage in runner.stages:
        compiled = runner.compilation.executable(ForwardKey(bucket, stage.index))
        text = compiled.as_text()
        own = sum(s.data.nbytes for x in jax.tree_util.tree_leaves((stage.params, stage.kv))
                  for s in x.addressable_shards if s.device == stage.mesh.devices.flat[0])
        if stage.last and runner.stable_buffers:  # the logits buffer it writes in place, f32[max_num_seqs, V]
            own += 4 * runner.max_num_seqs * stage.config.vocab_size
        facts[stage.index] = {
            # Result shapes, e.g. "f32[2,256]{1,0}": only logits may be gathered, never weights or KV.
            "all_gathers": re.findall(r"= (\S+) all-gather(?:-start)?\(", text),
            "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
            "argument_bytes": compiled.memory_analysis().argument_size_in_bytes,
            "own_bytes": own,
            "layers": [stage.layers.start, stage.layers.stop],
            "param_devices": devices_of(stage.params),
            "kv_devices": devices_of(stage.kv),
            "has_embed": "embed" in stage.params, "has_lm_head": "lm_head" in stage.params,
        }
    return facts


def main() -> None:
    results = {}
    for model in MODELS:
        for tp, pp in CASES:
            engine = engine_for(model, tp, pp)
            results[f"{model}/{tp}/{pp}"] = dict(run(engine), stages=program_facts(engine))
    # The same pipeline with one batch in flight: the same tokens, nothing overlapped.
    results["llama/2/2/one-in-flight"] = run(engine_for("llama", 2, 2, batches_in_flight=1))
    # Async scheduling on a pipeline: disjoint batches while requests remain to fill them, the batch
    # planned ahead (tokens read on the device) once every request is in flight; one request alone
    # is planned ahead each iteration.
    for tp, pp in ((1, 1), (1, 2), (2, 2)):
        results[f"llama/{tp}/{pp}/async"] = run(engine_for("llama", tp, pp, async_scheduling=True))
        results[f"llama/{tp}/{pp}/async-one"] = run_one(engine_for("llama", tp, pp, async_scheduling=True))
    results["llama/1/2/sync-one"] = run_one(engine_for("llama", 1, 2))
    # Random weights made stage by stage on the stages' devices: the same model as made whole.
    results["gpt/1/1/random-init"] = run(engine_for("gpt", 1, 1, random_init=True))
    results["gpt/2/2/random-init"] = run(engine_for("gpt", 2, 2, random_init=True))
    # Prefix caching on a mesh: the tokens of one device without caching.
    for tp, pp, caching in ((1, 1, False), (2, 2, False), (2, 2, True)):
        results[f"llama/{tp}/{pp}/prefix-{'on' if caching else 'off'}"] = run_shared(
            engine_for("llama", tp, pp, prefix_caching=caching))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
