"""Rehearsals of the GPT-3 layouts the multi-GPU runs use, on fake CPU devices: each preset's family and
vocabulary (50257, padded to a multiple of tp), scaled down so heads and layers still split the way the
real model's do, served through `LLM(tensor_parallel_size=, pipeline_parallel_size=)`; every layout's
tokens must be the one-device tokens, greedy and seeded sampling alike.

- GPT-3 175B on 4 H200s (issue 40): (tp, pp) = (4, 1) and (2, 2) on 4 devices. 96 heads split by 4 or 2,
  96 layers by 1 or 2; scaled to 8 heads (2 per shard at tp=4) and 4 layers.
- GPT-3 341B on 8 H200s (issue 38): (4, 2) on 8 devices. 120 heads split by 4 (30 per shard), 120
  layers by 2; scaled to 8 heads of 16 (2 per shard) and 4 layers (2 per stage).
"""

import dataclasses
import json

import pytest

from orca_jax.models.presets import get_preset
from tests.helpers.mesh import run_on_fake_devices

GPT3_VOCAB = 50257
LAYOUTS_175B = [(4, 1), (2, 2)]
SHAPE_175B = dict(hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=8, ffn_size=256,
                  max_seq_len=128)
LAYOUTS_341B = [(4, 2)]
SHAPE_341B = dict(hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=16, ffn_size=512,
                  max_seq_len=128)


def rehearse(num_devices: int, preset: str, shape: dict, layouts: list[tuple[int, int]]) -> dict:
    spec = json.dumps({"preset": preset, "shape": shape, "layouts": layouts})
    return run_on_fake_devices(num_devices, "-m", "tests.helpers.rehearsal", spec)


@pytest.fixture(scope="module")
def gpt3_175b():
    return rehearse(4, "gpt3-175b", SHAPE_175B, LAYOUTS_175B)


@pytest.fixture(scope="module")
def gpt3_341b():
    return rehearse(8, "gpt3-341b", SHAPE_341B, LAYOUTS_341B)


def check_layout(results: dict, shape: dict, tp: int, pp: int) -> None:
    one, mesh = results["1x1"], results[f"{tp}x{pp}"]
    assert mesh["parallel"] == [tp, pp]  # LLM's vLLM-named arguments reach the engine
    stages = mesh["stages"]
    per_stage = shape["num_layers"] // pp
    assert [s["layers"] for s in stages] == [[i * per_stage, (i + 1) * per_stage] for i in range(pp)]
    devices = [s["devices"] for s in stages]
    assert all(len(d) == tp for d in devices) and len({i for d in devices for i in d}) == tp * pp
    assert [s["param_devices"] for s in stages] == devices  # each stage's weights on its own devices only
    padded = -(-GPT3_VOCAB // tp) * tp
    assert padded > GPT3_VOCAB  # 50257 = 29 x 1733: no tp of 2, 4 or 8 divides it
    for s in stages:  # the first stage embeds; with tied embeddings the last stage's LM head is the table
        if s["embed_rows"] is not None:
            assert (s["embed_rows"], s["embed_shard_rows"]) == (padded, padded // tp)  # vocabulary-parallel
        assert (s["kv_heads"], s["kv_heads_per_device"]) == (shape["num_kv_heads"], shape["num_kv_heads"] // tp)
    assert stages[0]["embed_rows"] is not None and stages[-1]["embed_rows"] is not None
    assert one["stages"][0]["embed_rows"] == GPT3_VOCAB
    assert mesh["tokens"] == one["tokens"]
    for tokens in one["tokens"]:
        assert all(len(t) == 8 and max(t) < GPT3_VOCAB for t in tokens)  # no padded row is ever drawn


@pytest.mark.parametrize("tp, pp", LAYOUTS_175B)
def test_scaled_gpt3_175b_on_4_devices_gives_the_one_device_tokens(gpt3_175b, tp, pp):
    check_layout(gpt3_175b, SHAPE_175B, tp, pp)


@pytest.mark.parametrize("tp, pp", LAYOUTS_341B)
def test_scaled_gpt3_341b_on_8_devices_gives_the_one_device_tokens(gpt3_341b, tp, pp):
    check_layout(gpt3_341b, SHAPE_341B, tp, pp)


def test_the_scaled_shapes_split_as_the_presets_do():
    """The properties the rehearsals stand for: the real heads and layers split by the same (tp, pp)."""
    for preset, shape, layouts in (("gpt3-175b", SHAPE_175B, LAYOUTS_175B), ("gpt3-341b", SHAPE_341B, LAYOUTS_341B)):
        real = get_preset(preset)
        scaled = dataclasses.replace(real, **shape)
        assert scaled.vocab_size == GPT3_VOCAB and scaled.family == real.family
        for tp, pp in layouts:
            for config in (real, scaled):
                assert config.num_heads % tp == 0 and config.num_layers % pp == 0, (preset, tp, pp)
                assert config.num_heads // tp >= 2  # more than one head per shard, as the real model has
