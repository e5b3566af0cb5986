"""projections: the compute layout (q|k|v and gate|up fused) and its inverse, on the host."""

import dataclasses

import jax
import numpy as np
import pytest

from orca_jax.config import ModelConfig, ModelFamily
from orca_jax.models import decoder
from orca_jax.models.projections import fuse_projections, split_projections
from orca_jax.sharding import rules

GQA = ModelConfig(family=ModelFamily.LLAMA, vocab_size=64, hidden_size=32, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=4, ffn_size=48, max_seq_len=64, tie_embeddings=False, qkv_bias=True)
GPT = ModelConfig(family=ModelFamily.GPT, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=8, ffn_size=64, max_seq_len=64)


def _numpy_params(config):
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                                  decoder.param_shapes(config))


@pytest.mark.parametrize("config", [GQA, GPT], ids=["llama-gqa", "gpt"])
@pytest.mark.parametrize("stacked", [False, True])
def test_fusing_then_splitting_gives_the_params_back(config, stacked):
    params = _numpy_params(config)
    if stacked:
        params = decoder.stack_layers(params)
    fused = fuse_projections(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, split_projections(fused), params)
    # The compute layout is what the forward declares: same tree and shapes as its own shapes.
    want = decoder.compute_param_shapes(config)
    got = fused if not stacked else decoder.unstack_layers(fused)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert [x.shape for x in jax.tree_util.tree_leaves(got)] == [x.shape for x in jax.tree_util.tree_leaves(want)]


def test_a_kv_group_holds_its_query_heads_then_its_key_and_value():
    layer = _numpy_params(GQA)["layers"][1]
    fused = fuse_projections({"layers": [layer]})["layers"][0]
    qkv = fused["attn"]["qkv"]["kernel"]  # [H, K, G + 2, D]
    g = GQA.num_heads // GQA.num_kv_heads
    assert qkv.shape == (GQA.hidden_size, GQA.num_kv_heads, g + 2, GQA.head_dim)
    for head in range(GQA.num_heads):  # query head n attends KV head n // G: both in group n // G
        np.testing.assert_array_equal(qkv[:, head // g, head % g], layer["attn"]["q"]["kernel"][:, head])
    for j in range(GQA.num_kv_heads):
        np.testing.assert_array_equal(qkv[:, j, g], layer["attn"]["k"]["kernel"][:, j])
        np.testing.assert_array_equal(qkv[:, j, g + 1], layer["attn"]["v"]["kernel"][:, j])
        np.testing.assert_array_equal(fused["attn"]["qkv"]["bias"][j, g + 1], layer["attn"]["v"]["bias"][j])
    gate_up = fused["mlp"]["gate_up"]["kernel"]  # [H, 2, F]
    np.testing.assert_array_equal(gate_up[:, 0], layer["mlp"]["gate"]["kernel"])
    np.testing.assert_array_equal(gate_up[:, 1], layer["mlp"]["up"]["kernel"])


def test_every_compute_layout_param_has_a_sharding_rule():
    for config in (GQA, GPT, dataclasses.replace(GQA, qkv_bias=False)):
        for path, _ in jax.tree_util.tree_leaves_with_path(decoder.compute_param_shapes(config)):
            assert rules.path_name(path) in rules.PARAM_SPECS, path


@pytest.mark.parametrize("config", [GQA, GPT], ids=["llama-gqa", "gpt"])
def test_shapes_traced_from_one_layer_are_those_of_the_whole_init(config):
    """param_shapes traces one layer and repeats it; the init of every layer must agree, in both layouts."""
    config = dataclasses.replace(config, num_layers=3)
    key = jax.random.key(0)
    whole = jax.eval_shape(lambda: decoder._init_all(config, key))
    assert decoder.param_shapes(config) == whole
    assert decoder.compute_param_shapes(config) == jax.eval_shape(lambda: fuse_projections(decoder._init_all(config, key)))
