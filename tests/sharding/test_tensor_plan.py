"""tensor_plan: vocabulary padding, KV-head replication and refusals, checked on the host (no mesh)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.config import ModelConfig, ModelFamily, Quantization
from orca_jax.kernels.ragged_attention import ragged_attention_reference
from orca_jax.models import decoder, fp8, presets
from orca_jax.sharding import rules
from orca_jax.sharding.mesh import TENSOR
from orca_jax.sharding.tensor_plan import plan_for

GQA = ModelConfig(family=ModelFamily.LLAMA, vocab_size=255, hidden_size=32, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=4, ffn_size=64, max_seq_len=64, tie_embeddings=False)


def _numpy_params(config, seed=0):
    """Random numpy params of the device layout's shapes (no jit compile: these tests are about shapes)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype),
                                  decoder.param_shapes(config))


@pytest.mark.parametrize("name,tp,vocab,kv_heads", [
    ("gpt3-101b", 2, 50258, 80), ("gpt3-101b", 8, 50264, 80), ("gpt3-13b", 4, 50260, 40),
    ("gpt3-175b", 8, 50264, 96), ("llama-8b", 16, 128256, 16), ("smollm2-135m", 3, 49152, 3),
    ("tiny-llama", 4, 256, 4)])
def test_every_sharded_dimension_divides(name, tp, vocab, kv_heads):
    plan = plan_for(presets.get_preset(name), tp)
    assert (plan.device.vocab_size, plan.device.num_kv_heads) == (vocab, kv_heads)
    assert plan.vocab_size == presets.get_preset(name).vocab_size
    # Shapes only (eval_shape) of one layer (all are alike): gpt3-101b is never allocated.
    one_layer = dataclasses.replace(plan.device, num_layers=1)
    fp8 = dataclasses.replace(one_layer, quantization=Quantization.FP8)  # e4m3 projections and untied head
    shapes = [decoder.param_shapes(one_layer), decoder.compute_param_shapes(one_layer),  # both layouts
              decoder.compute_param_shapes(fp8)]
    for path, shape in jax.tree_util.tree_leaves_with_path(shapes):
        spec = rules.PARAM_SPECS[rules.path_name(path)]
        for size, axis in zip(shape.shape, spec):
            assert axis != TENSOR or size % tp == 0, (path, shape.shape)


def test_what_cannot_be_split_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match="tensor_parallel=2 does not divide num_heads=9"):
        plan_for(presets.get_preset("smollm2-135m"), 2)
    odd_ffn = dataclasses.replace(GQA, ffn_size=60)
    with pytest.raises(ValueError, match="tensor_parallel=8 does not divide ffn_size=60"):
        plan_for(odd_ffn, 8)
    # Not a refusal: 6 heads, 3 KV heads at tp=2 replicate to lcm(3, 2) = 6 KV heads.
    six = dataclasses.replace(GQA, num_heads=6, num_kv_heads=3)
    assert plan_for(six, 2).device.num_kv_heads == 6


def test_an_fp8_head_pads_zero_rows_of_scale_one_and_cuts_them_again():
    """A head already stored as FP8 (e4m3 [V, H], f32 [V]) pads as quantizing the padded head would."""
    plan = plan_for(GQA, 4)  # 255 -> 256
    head = {"lm_head": fp8.quantize(jnp.asarray(_numpy_params(GQA)["lm_head"]), num_in=1)}
    padded = plan.adapt_params(jax.tree_util.tree_map(np.asarray, head))["lm_head"]
    assert padded["weight"].shape == (256, 32) and padded["weight_scale"].shape == (256,)
    assert np.all(padded["weight"][255].astype(np.float32) == 0) and padded["weight_scale"][255] == 1.0
    np.testing.assert_array_equal(padded["weight_scale"][:255], np.asarray(head["lm_head"]["weight_scale"]))
    cut = plan.model_params({"lm_head": padded})["lm_head"]
    assert cut["weight"].shape == (255, 32) and cut["weight_scale"].shape == (255,)


def test_one_shard_changes_nothing():
    plan = plan_for(GQA, 1)
    params = _numpy_params(GQA)
    assert plan.is_identity and plan.adapt_params(params) is params


def test_padded_vocabulary_rows_and_columns_are_zero():
    plan = plan_for(GQA, 4)  # 255 -> 256
    params = _numpy_params(GQA)
    out = plan.adapt_params(params)
    assert out["embed"].shape == (256, 32) and out["lm_head"].shape == (32, 256)
    np.testing.assert_array_equal(out["embed"][:255], params["embed"])
    np.testing.assert_array_equal(out["embed"][255:], 0)
    np.testing.assert_array_equal(out["lm_head"][:, :255], params["lm_head"])
    np.testing.assert_array_equal(out["lm_head"][:, 255:], 0)


@pytest.mark.parametrize("stacked", [False, True])
def test_replicated_kv_heads_keep_the_query_to_kv_map(stacked):
    plan = plan_for(GQA, 8)  # 2 KV heads -> 8: each repeated 4 times
    assert plan.kv_repeat == 4
    params = _numpy_params(GQA)
    if stacked:
        params = decoder.stack_layers(params)
    out = plan.adapt_params(params)
    layer = (lambda p: jax.tree_util.tree_map(lambda x: x[1], p)) if stacked else (lambda p: p[1])
    k_model = layer(params["layers"])["attn"]["k"]["kernel"]  # [H, 2, D]
    k_device = layer(out["layers"])["attn"]["k"]["kernel"]  # [H, 8, D]
    n, kv_model, kv_device = GQA.num_heads, GQA.num_kv_heads, plan.device.num_kv_heads
    for head in range(n):  # query head n reads device KV head n // (N/K'), which must be its own
        np.testing.assert_array_equal(k_device[:, head // (n // kv_device)], k_model[:, head // (n // kv_model)])
    back = plan.model_params(out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)


def test_decoder_logits_mask_the_padding():
    plan = plan_for(GQA, 4)
    params = jax.tree_util.tree_map(jnp.asarray, plan.adapt_params(_numpy_params(GQA)))
    model = decoder.Decoder(plan.device, ragged_attention_reference, real_vocab_size=plan.vocab_size)
    x = jax.random.normal(jax.random.key(1), (3, GQA.hidden_size))
    logits = np.asarray(model.logits(params, x))  # [3, 256]
    assert logits.shape == (3, 256)
    assert np.all(logits[:, 255] == -np.inf) and np.all(np.isfinite(logits[:, :255]))
    unpadded = decoder.Decoder(GQA, ragged_attention_reference).logits(
        jax.tree_util.tree_map(jnp.asarray, _numpy_params(GQA)), x)
    np.testing.assert_allclose(logits[:, :255], unpadded, rtol=1e-6, atol=1e-6)


def test_random_init_draws_the_model_then_adapts():
    # So a random-weight preset is the same model on every mesh (one device is the reference).
    one_layer = dataclasses.replace(GQA, num_layers=1)
    plan = plan_for(one_layer, 4)
    direct = decoder.init_params(one_layer, seed=5, adapt=plan.adapt_params)
    drawn = jax.tree_util.tree_map(np.asarray, decoder.init_params(one_layer, seed=5))
    jax.tree_util.tree_map(np.testing.assert_array_equal, direct, plan.adapt_params(drawn))
