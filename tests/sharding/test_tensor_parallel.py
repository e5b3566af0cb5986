"""Tensor parallelism over fake CPU devices: the same tokens and logits as one device, for any preset shape.

The models are picked to need tensor_plan's two fixes: an odd vocabulary (padded, masked) and fewer KV
heads than shards (replicated). One subprocess with 8 fake devices runs every case.
"""

import textwrap

import numpy as np
import pytest

from tests.helpers.mesh import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import dataclasses, importlib.util, json, tempfile
    import numpy as np
    from orca_jax.config import (AttentionBackend, CacheConfig, EngineConfig, KVCacheDtype, ModelConfig, ModelFamily,
                                 ParallelConfig, Quantization, SchedulerConfig)
    from orca_jax.engine import Engine
    from orca_jax.models import decoder
    from orca_jax.models.loader import LoadedModel
    from orca_jax.sampling_params import SamplingParams
    from orca_jax.tokenizer import ByteTokenizer
    from tests.helpers.engines import drain, tiny_engine
    from tests.helpers.models import prompt_logits

    # 8-token iterations (prompts fed in chunks) and <= 32 tokens per sequence: one forward program per engine.
    PROMPTS = ([5, 6, 7], list(range(10, 34)), [99] * 9)
    # GQA with 2 KV heads (replicated at tp=4), an odd untied vocabulary (lm_head columns padded);
    # GPT with GPT-3's kind of vocabulary: odd, tied (embedding rows padded).
    MODELS = {
        "llama-gqa": ModelConfig(family=ModelFamily.LLAMA, vocab_size=255, hidden_size=64, num_layers=2,
                                 num_heads=8, num_kv_heads=2, head_dim=8, ffn_size=128, max_seq_len=128,
                                 tie_embeddings=False),
        "gpt-odd-vocab": ModelConfig(family=ModelFamily.GPT, vocab_size=257, hidden_size=64, num_layers=2,
                                     num_heads=4, num_kv_heads=4, head_dim=16, ffn_size=128, max_seq_len=128),
    }

    def run(engine):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), request_id=str(i))
        return drain(engine)

    def shard_info(runner):
        qkv = runner.stages[0].params["layers"][0]["attn"]["qkv"]["kernel"]  # [H, K, G + 2, D]
        return {"q_heads_per_shard": sorted({s.data.shape[1] * (s.data.shape[2] - 2) for s in qkv.addressable_shards}),
                "kv_heads_per_shard": sorted({s.data.shape[0] for s in runner.kv[-1].k.addressable_shards})}

    results = {}
    for name, config in MODELS.items():
        params = decoder.stack_layers(decoder.init_params(config, seed=3))  # numpy, as loaders return
        loaded = LoadedModel(config, params, ByteTokenizer())
        for tp in (1, 2, 4):
            engine = Engine(EngineConfig(model=name, cache=CacheConfig(page_size=4, num_pages=256),
                                         scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                                         parallel=ParallelConfig(tensor_parallel=tp), precompile=False), loaded)
            logits = prompt_logits(engine.runner, PROMPTS[1][:8])  # f32[8, padded V]
            real = config.vocab_size
            results[f"{name}/{tp}"] = dict(
                shard_info(engine.runner), tokens=run(engine), logits=logits[:, :real].tolist(),
                width=logits.shape[1], padding_all_neg_inf=bool(np.all(logits[:, real:] == -np.inf)),
                pages_used=engine.stats().kv_pages_used)
    # FP8 weights and FP8 KV pages: each scale split with its channels (row-parallel ones whole), the
    # untied head's e4m3 rows and scales over the vocabulary (255: padded at tp 2 and 4), on the last stage.
    config = MODELS["llama-gqa"]
    loaded = LoadedModel(config, decoder.stack_layers(decoder.init_params(config, seed=3)), ByteTokenizer())
    for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2)):
        engine = Engine(EngineConfig(model="fp8", cache=CacheConfig(page_size=4, num_pages=256),
                                     scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                                     parallel=ParallelConfig(tensor_parallel=tp, num_stages=pp), precompile=False,
                                     quantization=Quantization.FP8, kv_cache_dtype=KVCacheDtype.FP8), loaded)
        logits = prompt_logits(engine.runner, PROMPTS[1][:8]) if pp == 1 else None
        scales = engine.runner.stages[0].params["layers"][0]["mlp"]["gate_up"]["weight_scale"]  # [2, F]
        head = engine.runner.stages[-1].params["lm_head"]  # e4m3 [V, H], f32 [V]
        padded = slice(config.vocab_size, None)
        results[f"fp8/{tp}" + ("" if pp == 1 else f"x{pp}")] = dict(
            tokens=run(engine), logits=None if logits is None else logits[:, :config.vocab_size].tolist(),
            scale_columns_per_shard=sorted({x.data.shape[1] for x in scales.addressable_shards}),
            head_rows_per_shard=sorted({x.data.shape[0] for x in head["weight"].addressable_shards}),
            head_scale_rows_per_shard=sorted({x.data.shape[0] for x in head["weight_scale"].addressable_shards}),
            head_dtype=str(head["weight"].dtype), head_rows=head["weight"].shape[0],
            padded_rows_zero_scale_one=bool(np.all(np.asarray(head["weight"]).astype(np.float32)[padded] == 0)
                                            and np.all(np.asarray(head["weight_scale"])[padded] == 1)))
    # The Pallas kernels (interpret mode), each run per tensor shard through shard_map, against one
    # device's jnp path (the attention kernel wants head_dim >= 16).
    for name, config in MODELS.items():
        config = dataclasses.replace(config, head_dim=16)
        loaded = LoadedModel(config, decoder.stack_layers(decoder.init_params(config, seed=3)), ByteTokenizer())
        # (tp, stages): a pipeline's stages each run their decode program too.
        for (tp, pp), backend in (((1, 1), AttentionBackend.JNP), ((1, 1), AttentionBackend.PALLAS),
                                  ((2, 1), AttentionBackend.PALLAS), ((1, 2), AttentionBackend.PALLAS)):
            engine = Engine(EngineConfig(model=name, cache=CacheConfig(page_size=4, num_pages=256),
                                         scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                                         parallel=ParallelConfig(tensor_parallel=tp, num_stages=pp), precompile=False,
                                         attention=backend), loaded)
            logits = prompt_logits(engine.runner, PROMPTS[1][:8]) if pp == 1 else None
            results[f"{backend.value}/{name}/{tp}x{pp}"] = dict(
                tokens=run(engine), logits=None if logits is None else logits[:, :config.vocab_size].tolist())
    if importlib.util.find_spec("transformers") is not None:
        # A Hugging Face Qwen2 directory: random (non-zero) q/k/v biases split with their heads.
        from tests.helpers.hf_dirs import write_hf_dir
        qwen2 = tempfile.mkdtemp()
        write_hf_dir(qwen2, "qwen2")
        for tp in (1, 2):
            engine = tiny_engine(qwen2, parallel=ParallelConfig(tensor_parallel=tp))
            results[f"qwen2/{tp}"] = dict(shard_info(engine.runner), tokens=run(engine),
                                          pages_used=engine.stats().kv_pages_used)
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(8, "-c", SCRIPT)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["llama-gqa", "gpt-odd-vocab"])
def test_tensor_parallel_matches_one_device(results, model, tp):
    one, many = results[f"{model}/1"], results[f"{model}/{tp}"]
    assert many["tokens"] == one["tokens"] and len(one["tokens"]) == 3
    np.testing.assert_allclose(many["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    assert many["pages_used"] == 0


@pytest.mark.parametrize("model", ["llama-gqa", "gpt-odd-vocab"])
def test_pallas_kernels_on_a_tensor_mesh_match_one_device(results, model):
    """The attention and RoPE + page-write kernels and the decode programs, each tensor shard on its own
    heads and pages, each pipeline stage on its layers, give one device's jnp tokens."""
    reference = results[f"jnp/{model}/1x1"]
    assert len(reference["tokens"]) == 3
    for layout in ("1x1", "2x1", "1x2"):
        got = results[f"pallas/{model}/{layout}"]
        assert got["tokens"] == reference["tokens"], layout
        if got["logits"] is not None:
            np.testing.assert_allclose(got["logits"], reference["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model,vocab", [("llama-gqa", 255), ("gpt-odd-vocab", 257)])
def test_padded_vocabulary_is_masked(results, model, vocab):
    assert results[f"{model}/1"]["width"] == vocab  # nothing padded on one device
    for tp in (2, 4):
        assert results[f"{model}/{tp}"]["width"] == -(-vocab // tp) * tp
        assert results[f"{model}/{tp}"]["padding_all_neg_inf"]


def test_kv_heads_are_replicated_when_fewer_than_shards(results):
    # 8 query heads, 2 KV heads: tp=2 splits the KV heads, tp=4 repeats each twice (one per shard).
    assert results["llama-gqa/1"]["kv_heads_per_shard"] == [2]
    assert results["llama-gqa/2"]["q_heads_per_shard"] == [4]
    assert results["llama-gqa/2"]["kv_heads_per_shard"] == [1]
    assert results["llama-gqa/4"]["q_heads_per_shard"] == [2]
    assert results["llama-gqa/4"]["kv_heads_per_shard"] == [1]


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_weights_and_kv_match_one_device(results, tp):
    one, many = results["fp8/1"], results[f"fp8/{tp}"]
    assert many["tokens"] == one["tokens"] and len(one["tokens"]) == 3
    np.testing.assert_allclose(many["logits"], one["logits"], rtol=1e-4, atol=1e-4)
    assert many["scale_columns_per_shard"] == [128 // tp]  # gate|up's scales split over ffn columns


@pytest.mark.parametrize("layout", ["1", "2", "4", "1x2"])
def test_fp8_head_splits_its_rows_and_scales_over_the_padded_vocabulary(results, layout):
    """The untied head in e4m3 [V, H] with f32 [V] scales: split on V alike, the vocabulary (255) padded
    to the tensor size with zero rows of scale 1 (masked as before), on a pipeline's last stage too."""
    got, tp = results[f"fp8/{layout}"], int(layout[0])
    padded = -(-255 // tp) * tp
    assert got["head_dtype"] == "float8_e4m3fn" and got["head_rows"] == padded
    assert got["head_rows_per_shard"] == got["head_scale_rows_per_shard"] == [padded // tp]
    assert got["padded_rows_zero_scale_one"]
    assert got["tokens"] == results["fp8/1"]["tokens"]  # one device's tokens at (2,1), (4,1) and (1,2)


def test_qwen2_directory_biases_split_with_their_heads(results):
    if "qwen2/1" not in results:
        pytest.skip("transformers is not installed (it writes the Qwen2 directory)")
    one, two = results["qwen2/1"], results["qwen2/2"]
    assert two["q_heads_per_shard"] == [2] and two["kv_heads_per_shard"] == [1]
    assert two["tokens"] == one["tokens"] and two["pages_used"] == 0
