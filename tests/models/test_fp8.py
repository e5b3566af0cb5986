"""FP8 projection weights (models/fp8.py) against an independent numpy quantizer, and the engine with them.

The reference quantizes the model-layout weights in numpy (ml_dtypes' e4m3, one scale per output
channel) and dequantizes them back: a plain f32 model with those weights is what an FP8 engine must
compute, so decode-sized batches (W8A16) give the same greedy tokens and logits within f32 rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from orca_jax.config import KVCacheDtype, ModelConfig, ModelFamily, Quantization
from orca_jax.models import decoder, fp8
from orca_jax.models.loader import LoadedModel
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import ByteTokenizer
from tests.helpers.engines import drain, tiny_engine
from tests.helpers.models import prompt_logits

CONFIG = ModelConfig(family=ModelFamily.LLAMA, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, ffn_size=96, max_seq_len=128, tie_embeddings=False)
GPT = ModelConfig(family=ModelFamily.GPT, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=16, ffn_size=128, max_seq_len=128)
# Model-layout projection kernels and how many leading axes are input features.
MODEL_PROJECTIONS = {("attn", "q"): 1, ("attn", "k"): 1, ("attn", "v"): 1, ("attn", "o"): 2,
                     ("mlp", "gate"): 1, ("mlp", "up"): 1, ("mlp", "down"): 1}
PROMPTS = ([5, 6, 7], list(range(10, 40)), [99] * 9)


def numpy_fake_quantized(kernel: np.ndarray, num_in: int) -> np.ndarray:
    """kernel [L, in..., out...] rounded through e4m3 with one scale per (layer, output channel)."""
    w = np.asarray(kernel, np.float32)
    in_axes = tuple(range(1, 1 + num_in))
    scale = np.max(np.abs(w), axis=in_axes, keepdims=True) / 448.0
    scale = np.where(scale > 0, scale, 1.0)
    stored = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return stored.astype(np.float32) * scale


def reference_params(params: dict, head: bool = True) -> dict:
    """A stacked model-layout tree with every projection replaced by its FP8 round trip (numpy), and
    with `head` an untied LM head [H, V] too (one scale per vocabulary column)."""
    out = dict(params, layers={block: dict(v) for block, v in params["layers"].items()})
    for (block, name), num_in in MODEL_PROJECTIONS.items():
        if name in params["layers"][block]:
            proj = dict(params["layers"][block][name])
            proj["kernel"] = numpy_fake_quantized(proj["kernel"], num_in)
            out["layers"][block][name] = proj
    if head and "lm_head" in params:
        out["lm_head"] = numpy_fake_quantized(params["lm_head"][None], 1)[0]
    return out


def run(engine, prompts=PROMPTS, max_tokens=8) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i))
    return drain(engine)


def test_quantize_is_per_output_channel_and_round_trips():
    kernel = jax.random.normal(jax.random.key(0), (64, 4, 3, 16), jnp.float32)  # qkv: [H, K, G + 2, D]
    stored = fp8.quantize(kernel, num_in=1)
    assert stored["weight"].dtype == jnp.float8_e4m3fn and stored["weight"].shape == (4, 3, 16, 64)
    assert stored["weight_scale"].shape == (4, 3, 16)
    # Every channel's largest stored magnitude is e4m3's largest value.
    np.testing.assert_allclose(np.max(np.abs(np.asarray(stored["weight"], np.float32)), axis=-1), 448.0)
    back = fp8.dequantize(stored["weight"], stored["weight_scale"], jnp.float32)
    np.testing.assert_allclose(np.asarray(back), numpy_fake_quantized(np.asarray(kernel)[None], 1)[0], rtol=1e-6)
    assert float(jnp.linalg.norm(back - kernel) / jnp.linalg.norm(kernel)) < 0.04  # e4m3's 3 mantissa bits


def test_zero_channel_gets_scale_one_and_no_nan():
    kernel = jnp.zeros((8, 4), jnp.float32).at[:, 1].set(1.0)
    stored = fp8.quantize(kernel, num_in=1)
    assert float(stored["weight_scale"][0]) == 1.0
    assert not np.isnan(np.asarray(fp8.dequantize(stored["weight"], stored["weight_scale"], jnp.float32))).any()


@pytest.mark.parametrize("form", list(fp8.MatmulForm))
def test_linear_forms_against_dequantized_weights(form):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (5, 4, 16), jnp.float32)  # o projection: [T, N, D]
    kernel = jax.random.normal(kw, (4, 16, 64), jnp.float32)  # [N, D, H]
    stored = fp8.quantize(kernel, num_in=2)
    y = fp8.linear(x, stored["weight"], stored["weight_scale"], form)
    ref = jnp.einsum("TND,NDH->TH", x, fp8.dequantize(stored["weight"], stored["weight_scale"], jnp.float32))
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    # W8A16 computes with the weights' exact values; W8A8 also rounds the activations to e4m3.
    assert err < (1e-5 if form is fp8.MatmulForm.W8A16 else 0.05), err


def test_form_depends_only_on_rows():
    assert fp8.form_for(1) is fp8.MatmulForm.W8A16
    assert fp8.form_for(fp8.W8A16_MAX_ROWS) is fp8.MatmulForm.W8A16
    assert fp8.form_for(fp8.W8A16_MAX_ROWS + 1) is fp8.MatmulForm.W8A8


def test_compute_param_shapes_store_projections_as_fp8():
    shapes = decoder.compute_param_shapes(dataclasses.replace(CONFIG, quantization=Quantization.FP8))
    layer = shapes["layers"][0]
    assert layer["attn"]["qkv"]["weight"].dtype == jnp.float8_e4m3fn
    assert layer["attn"]["qkv"]["weight"].shape == (2, 4, 16, 64)  # [K, G + 2, D, H]
    assert layer["attn"]["o"]["weight"].shape == (64, 4, 16)  # [H, N, D]
    assert layer["mlp"]["gate_up"]["weight_scale"].shape == (2, 96)
    assert "kernel" not in layer["mlp"]["down"]
    assert shapes["embed"].dtype == jnp.float32  # the embedding lookup stays in dtype
    # The untied head, one scale per vocabulary row: e4m3 [V, H], f32 [V].
    assert shapes["lm_head"]["weight"].dtype == jnp.float8_e4m3fn and shapes["lm_head"]["weight"].shape == (256, 64)
    assert shapes["lm_head"]["weight_scale"].dtype == jnp.float32 and shapes["lm_head"]["weight_scale"].shape == (256,)
    kept = decoder.compute_param_shapes(dataclasses.replace(CONFIG, quantization=Quantization.FP8, quantize_lm_head=False))
    assert kept["lm_head"].dtype == jnp.float32 and kept["lm_head"].shape == (64, 256)  # the switch off: [H, V]
    tied = decoder.compute_param_shapes(dataclasses.replace(CONFIG, quantization=Quantization.FP8, tie_embeddings=True))
    assert "lm_head" not in tied and tied["embed"].dtype == jnp.float32  # a tied table is the lookup too


@pytest.mark.parametrize("rows", [3, fp8.W8A16_MAX_ROWS + 16], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_head_logits_equal_the_dequantized_heads_in_f32(rows, dtype):
    """The logits read the stored e4m3 head and come back f32, as the 16-bit head's do (not rounded to
    the model's dtype): equal to numpy's product with the same e4m3 values times their scales."""
    config = dataclasses.replace(CONFIG, quantization=Quantization.FP8, dtype=dtype)
    params = decoder.to_compute_layout(decoder.init_params(config, seed=2), config)
    head = params["lm_head"]
    model = decoder.Decoder(config, attention_fn=None)
    x = jax.random.normal(jax.random.key(4), (rows, config.hidden_size), jnp.float32).astype(dtype)
    logits = model.logits(params, x)
    assert logits.dtype == jnp.float32 and logits.shape == (rows, config.vocab_size)
    # Reference: the final norm (the decoder's own), then numpy in f64.
    normed = decoder.Norm(config).apply({"params": params["final_norm"]}, x)
    xs = np.asarray(normed, np.float64)
    if rows > fp8.W8A16_MAX_ROWS:  # W8A8: each row rounded through e4m3 with its own scale too (the
        # activations' rounding is test_linear_forms_against_dequantized_weights'; here the same rows)
        xq, row_scale = fp8.quantize_rows(normed)
        xs = np.asarray(xq).astype(np.float64) * np.asarray(row_scale, np.float64)
    weight = np.asarray(head["weight"]).astype(np.float64) * np.asarray(head["weight_scale"], np.float64)[:, None]
    np.testing.assert_allclose(np.asarray(logits), xs @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config,head", [(CONFIG, True), (CONFIG, False), pytest.param(GPT, True, marks=pytest.mark.slow)],
                         ids=["llama", "llama-head-kept", "gpt"])
def test_fp8_engine_equals_f32_engine_on_the_round_tripped_weights(config, head):
    """`head`: the untied LM head quantized (the default) and the reference's head round-tripped too;
    off (quantize_lm_head=False), the head stays as it was and the reference's head is the original."""
    params = decoder.stack_layers(decoder.init_params(config, seed=3))
    # 16-token iterations: every bucket is W8A16's (fp8.W8A16_MAX_ROWS), a few small programs.
    quantized = tiny_engine(config.family.value, loaded=LoadedModel(config, params, ByteTokenizer()),
                            max_num_batched_tokens=16, quantization=Quantization.FP8, quantize_lm_head=head)
    reference = tiny_engine(config.family.value, loaded=LoadedModel(config, reference_params(params, head), ByteTokenizer()),
                            max_num_batched_tokens=16)
    np.testing.assert_allclose(prompt_logits(quantized.runner, PROMPTS[1][:16]),
                               prompt_logits(reference.runner, PROMPTS[1][:16]), rtol=2e-4, atol=2e-4)
    assert run(quantized) == run(reference)
    stored = quantized.runner.stages[-1].params.get("lm_head")
    assert isinstance(stored, dict) == (head and not config.tie_embeddings)
    # Half the bytes: the stored projections (and head) are e4m3; the engine counts what it placed.
    plain = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(decoder.compute_param_shapes(config)))
    assert quantized.runner.params_bytes < 0.75 * plain
    if config.family is ModelFamily.LLAMA:  # weight_bytes counts all but the norms' f32 scales
        norms = (2 * config.num_layers + 1) * config.hidden_size
        assert quantized.runner.params_bytes == quantized.runner.config.weight_bytes + 4 * norms


def test_weight_bytes_count_the_quantized_head():
    h, v = CONFIG.hidden_size, CONFIG.vocab_size
    fp8_config = dataclasses.replace(CONFIG, quantization=Quantization.FP8)
    kept = dataclasses.replace(fp8_config, quantize_lm_head=False)
    assert fp8_config.lm_head_quantized and not kept.lm_head_quantized
    assert fp8_config.num_projection_params == kept.num_projection_params + v * h
    assert fp8_config.num_output_channels == kept.num_output_channels + v
    # f32 [H, V] (4 bytes each) against e4m3 [V, H] and an f32 scale per row.
    assert kept.weight_bytes - fp8_config.weight_bytes == 4 * v * h - (v * h + 4 * v)
    tied = dataclasses.replace(fp8_config, tie_embeddings=True)
    assert not tied.lm_head_quantized
    assert tied.num_projection_params == kept.num_projection_params


def test_random_preset_quantized_on_device_matches_host_quantization():
    """Random weights are drawn and quantized inside the per-layer program; the same weights placed from
    the host and quantized there give the same tokens."""
    config = dataclasses.replace(CONFIG, dtype="float32")
    drawn = tiny_engine("llama", loaded=LoadedModel(config, None, ByteTokenizer()), seed=5,
                        max_num_batched_tokens=16, quantization=Quantization.FP8)
    host = decoder.stack_layers(decoder.init_params(config, seed=5))
    placed = tiny_engine("llama", loaded=LoadedModel(config, host, ByteTokenizer()), max_num_batched_tokens=16,
                         quantization=Quantization.FP8)
    assert run(drawn) == run(placed)


def test_fp8_kv_pages_hold_twice_the_tokens_and_track_the_model():
    config = dataclasses.replace(CONFIG, dtype="bfloat16")
    params = decoder.stack_layers(decoder.init_params(config, seed=3))
    loaded = LoadedModel(config, params, ByteTokenizer())
    bf16 = tiny_engine("llama", loaded=loaded, max_num_batched_tokens=16)
    fp8_kv = tiny_engine("llama", loaded=loaded, max_num_batched_tokens=16, kv_cache_dtype=KVCacheDtype.FP8)
    assert fp8_kv.runner.kv[0].k.dtype == jnp.float8_e4m3fn
    assert fp8_kv.runner.config.kv_bytes_per_token * 2 == bf16.runner.config.kv_bytes_per_token
    assert fp8_kv.runner.kv_bytes * 2 == bf16.runner.kv_bytes  # same pages, half the bytes
    a, b = prompt_logits(bf16.runner, PROMPTS[1][:16]), prompt_logits(fp8_kv.runner, PROMPTS[1][:16])
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.05
    assert set(run(fp8_kv)) == {"0", "1", "2"}


@pytest.mark.slow  # ~40 s: two LoRA engines
def test_lora_adapters_on_an_fp8_base_match_the_round_tripped_base():
    """Adapters stay in the model's dtype; their term is added to the FP8 projection's output."""
    from orca_jax.config import LoRAConfig
    from orca_jax.lora import LoRARequest
    from orca_jax.lora.adapter import random_adapter

    config = dataclasses.replace(CONFIG, dtype="float32")
    params = decoder.stack_layers(decoder.init_params(config, seed=3))
    lora = LoRAConfig(max_loras=1, max_lora_rank=8)
    engines = [tiny_engine("llama", loaded=LoadedModel(config, p, ByteTokenizer()), lora=lora,
                           max_num_batched_tokens=16, **q)
               for p, q in ((params, {"quantization": Quantization.FP8}), (reference_params(params), {}))]
    request = LoRARequest("a", 1, "(in memory)")
    outputs = []
    for engine in engines:
        engine.add_lora(request, random_adapter(engine.model_config, 4, seed=1, name="a", b_std=0.3))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"l{i}",
                               lora_request=request)
            engine.add_request(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"b{i}")
        outputs.append(drain(engine))
    assert outputs[0] == outputs[1]
    assert any(outputs[0][f"l{i}"] != outputs[0][f"b{i}"] for i in range(len(PROMPTS)))  # the adapter acts


def test_fp8_pages_with_prefix_caching_equal_caching_off():
    """Shared prefix pages hold e4m3 K/V like any other: caching on gives caching off's tokens."""
    config = dataclasses.replace(CONFIG, dtype="bfloat16")
    loaded = LoadedModel(config, decoder.stack_layers(decoder.init_params(config, seed=3)), ByteTokenizer())
    shared = list(range(20, 60))
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
    tokens = []
    for caching in (True, False):
        engine = tiny_engine("llama", loaded=loaded, prefix_caching=caching, kv_cache_dtype=KVCacheDtype.FP8,
                             quantization=Quantization.FP8, max_num_batched_tokens=16)
        out = {}
        for i, prompt in enumerate(prompts):  # one after another, so later prompts find the pages cached
            engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), request_id=str(i))
            out.update(drain(engine))
        tokens.append(out)
        assert (engine.stats().prefix_cache_hits > 0) == caching
    assert tokens[0] == tokens[1]
