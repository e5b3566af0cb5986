"""Rehearsal of issue 12's layout on 4 fake CPU devices: GPT-3 175B's family and vocabulary (50257, padded),
scaled down to 4 layers of hidden 64, served through `LLM(tensor_parallel_size=2, pipeline_parallel_size=PP)`;
its tokens must be the one-device tokens, greedy and seeded sampling alike.

PIPELINE_STAGES is 1 until pipeline stages land (branch `pipe`); flipping it to 2 makes this the exact
(tp, pp) = (2, 2) layout that issue 12 runs on 4 H200s.
"""

import textwrap

import pytest

from tests.helpers.mesh import run_on_fake_devices

PIPELINE_STAGES = 2  # the exact (tp, pp) = (2, 2) layout of issue 12

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import jax
    from orca_jax import LLM, SamplingParams
    from orca_jax.models import decoder, presets
    from orca_jax.models.loader import LoadedModel
    from orca_jax.tokenizer import ByteTokenizer

    pp = int(sys.argv[1])
    config = dataclasses.replace(presets.get_preset("gpt3-175b"), hidden_size=64, num_layers=4, num_heads=4,
                                 num_kv_heads=4, head_dim=16, ffn_size=256, max_seq_len=128, dtype="float32")
    params = decoder.stack_layers(decoder.init_params(config, seed=7))
    loaded = LoadedModel(config, params, ByteTokenizer(config.eos_token_ids))
    prompts = [[464, 3290, 318], list(range(1000, 1020)), [50256, 11, 50000]]
    # Seeded sampling at a low temperature: these random weights give near-uniform logits over 50257
    # tokens, and a mesh's logits differ from one device's by ~4e-7 (all-reduce order), which at
    # temperature 0.8 moves the sampling CDF across a boundary every few dozen draws. At 0.1 the
    # candidates are far apart, so equal tokens test the mesh, not the float noise.
    sampling = [SamplingParams(max_tokens=8, ignore_eos=True),
                SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.1, seed=11)]
    out = {}
    for tp, stages in ((1, 1), (2, pp)):
        llm = LLM("gpt3-175b-scaled", tensor_parallel_size=tp, pipeline_parallel_size=stages, loaded=loaded,
                  max_num_seqs=8, max_num_batched_tokens=8, page_size=4, num_kv_pages=128)
        parallel = llm.engine.config.parallel
        embed = [a for a in jax.live_arrays() if a.shape[0] == -(-config.vocab_size // tp) * tp and a.ndim == 2]
        out[f"{tp}x{stages}"] = {
            "parallel": [parallel.tensor_parallel, parallel.num_stages],
            "embed_rows": sorted({a.shape[0] for a in embed}),
            "embed_devices": sorted({len(a.devices()) for a in embed}),
            "tokens": [[o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] for sp in sampling]}
        del llm, embed
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(4, "-c", SCRIPT, str(PIPELINE_STAGES))


def test_scaled_gpt3_on_the_issue_12_layout_gives_the_one_device_tokens(results):
    one, mesh = results["1x1"], results[f"2x{PIPELINE_STAGES}"]
    assert mesh["parallel"] == [2, PIPELINE_STAGES]  # LLM's vLLM-named arguments reach the engine
    assert mesh["embed_rows"] == [50258]  # 50257 padded to a multiple of tp=2
    assert max(mesh["embed_devices"]) >= 2  # split over the tensor group, not one device's copy
    assert one["embed_rows"] == [50257]
    assert mesh["tokens"] == one["tokens"]
    assert all(len(t) == 8 for t in one["tokens"][0])
