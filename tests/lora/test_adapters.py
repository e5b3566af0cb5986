"""Reading peft adapter directories: the layout and scaling we serve, and every adapter we refuse (each
with a message naming the adapter and the problem). Files are written with safetensors and json
directly, as peft writes them, so these run without torch."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from orca_jax.config import LoRAConfig
from orca_jax.lora.adapter import LoRAError, load_adapter, random_adapter
from orca_jax.lora.layout import layer_shapes, slot_layer
from orca_jax.lora.manager import LoRAManager
from orca_jax.lora.request import LoRARequest
from orca_jax.models.presets import PRESETS

from tests.helpers.lora import write_llama_adapter

LLAMA = PRESETS["tiny-llama"]  # H 64, 4 heads of 16, 2 KV heads, F 128, 2 layers
GPT = PRESETS["tiny-gpt"]  # H 64, 4 heads of 16, F 256
def test_layout_and_scaling(tmp_path):
    tensors = write_llama_adapter(tmp_path / "a", r=4, alpha=8, targets=("q_proj", "down_proj"))
    adapter = load_adapter(str(tmp_path / "a"), "a", LLAMA, max_rank=8)
    assert adapter.rank == 4 and set(adapter.layers[1]) == {"q", "down"}
    a, b = adapter.layers[1]["q"]
    peft_a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    peft_b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    x = np.random.default_rng(1).standard_normal((3, 64), np.float32)
    # ours: x [T, H] @ a [H, r] @ b [r, N, D]; peft: scaling * B @ A @ x with scaling = alpha / r
    np.testing.assert_allclose(np.einsum("th,hr,rnd->tnd", x, a, b).reshape(3, 64),
                               2.0 * x @ peft_a.T @ peft_b.T, rtol=1e-5, atol=1e-5)


def test_rslora_and_patterns_scale_per_module(tmp_path):
    write_llama_adapter(tmp_path / "a", r=4, alpha=8, targets=("q_proj", "v_proj"),
                        config={"use_rslora": True, "alpha_pattern": {"v_proj": 2}})
    adapter = load_adapter(str(tmp_path / "a"), "a", LLAMA, max_rank=8)
    write_llama_adapter(tmp_path / "plain", r=4, alpha=4, targets=("q_proj", "v_proj"))  # same seed: same tensors
    plain = load_adapter(str(tmp_path / "plain"), "plain", LLAMA, max_rank=8)  # scaling 1
    np.testing.assert_allclose(adapter.layers[0]["q"][1], plain.layers[0]["q"][1] * 8 / math.sqrt(4), rtol=1e-6)
    np.testing.assert_allclose(adapter.layers[0]["v"][1], plain.layers[0]["v"][1] * 2 / math.sqrt(4), rtol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(config={"use_dora": True}), r"'bad': .*adapter_config.json: DoRA \(use_dora\) is not supported"),
    (dict(config={"bias": "all"}), r"'bad': .*bias must be \"none\" \(trained base biases are not supported\)"),
    (dict(config={"modules_to_save": ["lm_head"]}), r"'bad': .*fully trained modules \(modules_to_save\) is not supported"),
    (dict(config={"peft_type": "IA3"}), r"'bad': .*peft_type must be \"LORA\""),
    (dict(targets=("q_proj", "embed_tokens")), r"'bad': target_modules names a module this llama model cannot adapt"),
    (dict(r=16), r"'bad': rank 16 is above the server's maximum \(8; see --max-lora-rank\)"),
    (dict(layers=(0, 5)), r"'bad': .*layers\.5\.self_attn\.q_proj: the base model has 2 layers"),
    (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((48, 4), np.float32)}),
     r"'bad': .*q_proj: lora_B does not fit the base model \(expected shape \(64, 4\) for rank 4\)"),
    (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32)}),
     r"'bad': .*q_proj: lora_B is missing"),
    (dict(tensors={"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32),
                   "base_model.model.lm_head.lora_B.weight": np.zeros((256, 4), np.float32)}),
     r"'bad': .*holds a tensor that is not the lora_A or lora_B weight of a module a llama model can adapt"),
    (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 256), np.float32)}),
     r"'bad': .*holds a tensor that is not the lora_A or lora_B weight"),
])
def test_bad_adapters_are_refused_by_name(tmp_path, change, message):
    write_llama_adapter(tmp_path / "bad", **change)
    with pytest.raises(LoRAError, match=message):
        load_adapter(str(tmp_path / "bad"), "bad", LLAMA, max_rank=8)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(LoRAError, match=r"'gone': .*/gone: no such directory"):
        load_adapter(str(tmp_path / "gone"), "gone", LLAMA, max_rank=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match=r"'empty': .*adapter_config.json: no such file"):
        load_adapter(str(tmp_path / "empty"), "empty", LLAMA, max_rank=8)
    write_llama_adapter(tmp_path / "nobin")
    (tmp_path / "nobin" / "adapter_model.safetensors").rename(tmp_path / "nobin" / "adapter_model.bin")
    with pytest.raises(LoRAError, match=r"'nobin': .*adapter_model.safetensors: no such file \(only safetensors"):
        load_adapter(str(tmp_path / "nobin"), "nobin", LLAMA, max_rank=8)
    write_llama_adapter(tmp_path / "json")
    (tmp_path / "json" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match=r"'json': .*adapter_config.json is not valid JSON"):
        load_adapter(str(tmp_path / "json"), "json", LLAMA, max_rank=8)


def test_gpt2_names_map_to_our_projections(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": rng.standard_normal((2, 64), np.float32),
               "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": rng.standard_normal((192, 2), np.float32),
               "base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight": rng.standard_normal((2, 256), np.float32),
               "base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight": rng.standard_normal((64, 2), np.float32)}
    write_llama_adapter(tmp_path / "g", r=2, alpha=2, targets=("c_attn", "c_proj"), tensors=tensors)
    adapter = load_adapter(str(tmp_path / "g"), "g", GPT, max_rank=4)
    assert set(adapter.layers[0]) == {"q", "k", "v"} and set(adapter.layers[1]) == {"down"}
    b = tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"]  # [q | k | v, r]
    np.testing.assert_array_equal(adapter.layers[0]["k"][1].reshape(2, 64), b[64:128].T)
    write_llama_adapter(tmp_path / "x", targets=("q_proj",))
    with pytest.raises(LoRAError, match=r"'g': target_modules names a module this gpt model cannot adapt \(it can adapt"):
        load_adapter(str(tmp_path / "x"), "g", GPT, max_rank=4)


def test_slot_layer_pads_rank_and_repeats_kv_heads():
    adapter = random_adapter(LLAMA, rank=3, seed=0)
    device = dataclasses.replace(LLAMA, num_kv_heads=4)  # tp=4: each of the 2 KV heads twice
    slot = slot_layer(adapter.layers[0], device, kv_repeat=2, rank=8, dtype=np.float32)
    shapes = layer_shapes(device, 1, 8)
    assert slot["attn"]["qkv"]["b_kv"].shape == shapes["attn/qkv/b_kv"] == (2, 1, 8, 4, 16)
    k_b = adapter.layers[0]["k"][1]  # [3, 2, 16]
    np.testing.assert_array_equal(slot["attn"]["qkv"]["b_kv"][0, 0, :3, ::2], k_b)
    np.testing.assert_array_equal(slot["attn"]["qkv"]["b_kv"][0, 0, :3, 1::2], k_b)
    assert not slot["attn"]["qkv"]["b_kv"][:, :, 3:].any() and not slot["attn"]["qkv"]["a"][..., 3:].any()


def test_manager_keeps_at_most_max_cpu_loras_idle_adapters_in_host_memory(tmp_path):
    uploads = []
    manager = LoRAManager(LoRAConfig(max_loras=1, max_cpu_loras=2), LLAMA, lambda slot, a: uploads.append((slot, a.name)))
    for i in range(4):
        write_llama_adapter(tmp_path / f"a{i}", seed=i)
        manager.add(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    assert [lora.lora_name for lora in manager.list()] == ["a0", "a1", "a2", "a3"]
    assert len(manager._host) == 2  # the two least recently registered were dropped (read again on use)
    manager.request_added("r", LoRARequest("a0", 1, str(tmp_path / "a0")))  # read from disk again
    assert 1 in manager._host
    with pytest.raises(LoRAError, match="'a0' is already loaded"):
        manager.add(LoRARequest("a0", 9, str(tmp_path / "a1")))
    with pytest.raises(LoRAError, match="lora_int_id 2 is already used by adapter 'a1'"):
        manager.add(LoRARequest("other", 2, str(tmp_path / "a1")))
    assert manager.remove(2) and not manager.remove(2)
    with pytest.raises(LoRAError, match="lora_int_id 2 belonged to an adapter that was unloaded"):
        manager.add(LoRARequest("a1", 2, str(tmp_path / "a1")))
    with pytest.raises(ValueError, match="duplicate request_id 'r'"):
        manager.request_added("r", LoRARequest("a0", 1, str(tmp_path / "a0")))


def test_flags_and_config_checks():
    from orca_jax.config import EngineConfig, ParallelConfig
    from orca_jax.serve import build_parser, engine_config_from_args
    from orca_jax.server.lora import parse_lora_modules

    parse = lambda *argv: engine_config_from_args(build_parser().parse_args(list(argv)))  # noqa: E731
    assert parse().lora is None
    assert parse("--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8").lora == \
        LoRAConfig(max_loras=4, max_lora_rank=32, max_cpu_loras=8)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        parse("--lora-modules", "a=/x")
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [("a", "/x"), ("b", "/y")]
    for bad, message in (("a", "expected name=path"), ('{"name": "b"}', "not a JSON object with name and path")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="names an adapter twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="not supported with several controller processes"):
        EngineConfig(lora=LoRAConfig(), parallel=ParallelConfig(num_processes=2, coordinator_address="h:1"))
