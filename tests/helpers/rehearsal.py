"""A GPT-3 preset scaled down and served through `LLM` at one device and at each (tp, pp) layout asked for,
all in one process on fake CPU devices; prints, per layout, the tokens (greedy and seeded) and where the
stages put the weights, the padded vocabulary and the K/V heads. Run by run_on_fake_devices:

  python -m tests.helpers.rehearsal '{"preset": "gpt3-175b", "shape": {...}, "layouts": [[4, 1], [2, 2]]}'
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

from orca_jax import LLM, SamplingParams
from orca_jax.models import decoder, presets
from orca_jax.models.loader import LoadedModel
from orca_jax.tokenizer import ByteTokenizer

# 50256 is GPT-3's last real row (and its EOS): next to the padded rows a tp > 1 adds.
PROMPTS = [[464, 3290, 318], list(range(1000, 1020)), [50256, 11, 50000]]
MAX_TOKENS = 8
# Seeded sampling at a low temperature: random weights give near-uniform logits over 50257 tokens, and a
# mesh's logits differ from one device's by ~4e-7 (all-reduce order), which at temperature 0.8 moves the
# sampling CDF across a boundary every few dozen draws. At 0.1 the candidates are far apart, so equal
# tokens test the mesh, not the float noise.
SAMPLING = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.1, seed=11)]


def shard_shape(array: jax.Array) -> list[int]:
    return list(array.sharding.shard_shape(array.shape))


def stage_facts(stage) -> dict:
    """Where one pipeline stage keeps its layers, weights, vocabulary rows and K/V heads."""
    params = stage.params
    embed = params.get("embed")
    return {
        "layers": [stage.layers.start, stage.layers.stop],
        "devices": sorted(d.id for d in stage.mesh.devices.flat),
        "param_devices": sorted({d.id for x in jax.tree_util.tree_leaves(params) for d in x.sharding.device_set}),
        "embed_rows": None if embed is None else embed.shape[0],  # [V_padded, H]
        "embed_shard_rows": None if embed is None else shard_shape(embed)[0],
        "kv_heads": stage.kv[0].k.shape[0],  # [KVH, num_pages, page_size, D]
        "kv_heads_per_device": shard_shape(stage.kv[0].k)[0],
    }


def rehearse(preset: str, shape: dict, layouts: list[tuple[int, int]]) -> dict:
    config = dataclasses.replace(presets.get_preset(preset), **shape, dtype="float32")
    params = decoder.stack_layers(decoder.init_params(config, seed=7))
    loaded = LoadedModel(config, params, ByteTokenizer(config.eos_token_ids))
    out = {}
    for tp, pp in [(1, 1), *layouts]:
        # precompile off: only the buckets these few requests use compile (a fifth of the time on CPU).
        llm = LLM(f"{preset}-scaled", tensor_parallel_size=tp, pipeline_parallel_size=pp, loaded=loaded,
                  max_num_seqs=8, max_num_batched_tokens=8, page_size=4, num_kv_pages=128, precompile=False)
        parallel = llm.engine.config.parallel
        out[f"{tp}x{pp}"] = {
            "parallel": [parallel.tensor_parallel, parallel.num_stages],
            "stages": [stage_facts(stage) for stage in llm.engine.runner.stages],
            "tokens": [[o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] for sp in SAMPLING]}
        del llm
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(rehearse(spec["preset"], spec["shape"], [tuple(layout) for layout in spec["layouts"]])))
