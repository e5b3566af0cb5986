"""FP8 checkpoints in their published formats load to what quantizing the 16/32-bit weights at load gives.

Each test writes a tiny Llama with transformers, then rewrites its projection weights the way the
format's own tools store them (tensor names, dtypes, scales and config.json's quantization_config), and
compares greedy tokens with the original directory served with quantization=FP8.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from orca_jax.config import Quantization
from orca_jax.models.hf_checkpoint import load_hf_directory
from orca_jax.models.loader import load_model, read_model_config
from orca_jax.models.weights import WeightsError
from orca_jax.sampling_params import SamplingParams
from tests.helpers.engines import drain, tiny_engine
from tests.helpers.hf_dirs import write_hf_dir

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ([5, 6, 7], list(range(10, 40)))


def _quantize(w, scheme: str):
    """torch [out, in] f32 -> (e4m3 weight, scale tensor, scale name) as the format stores them."""
    import torch

    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [out, 1]
        return (w / scale).to(torch.float8_e4m3fn), scale, "weight_scale"
    if scheme == "tensor":
        scale = w.abs().amax().reshape(1) / 448.0  # [1]
        return (w / scale).to(torch.float8_e4m3fn), scale, "weight_scale"
    assert scheme == "block"
    out, inp = w.shape
    b = 32  # a tiny model's blocks (real checkpoints use 128): several per weight, ragged at the edge
    rows, cols = -(-out // b), -(-inp // b)
    scale = torch.zeros(rows, cols)
    q = torch.zeros_like(w)
    for i in range(rows):
        for j in range(cols):
            block = w[i * b:(i + 1) * b, j * b:(j + 1) * b]
            scale[i, j] = block.abs().amax() / 448.0
            q[i * b:(i + 1) * b, j * b:(j + 1) * b] = block / scale[i, j]
    return q.to(torch.float8_e4m3fn), scale, "weight_scale_inv"


QUANT_CONFIGS = {
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                          "symmetric": True, "dynamic": False},
                                              "input_activations": {"num_bits": 8, "type": "float",
                                                                    "strategy": "token", "dynamic": True}}}},
    "tensor": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"],
                                             "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                         "symmetric": True, "dynamic": False},
                                             "input_activations": {"num_bits": 8, "type": "float",
                                                                   "strategy": "tensor", "dynamic": False}}}},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
}


def _values(q, scale, scheme: str):
    """The f32 weight an FP8 tensor stands for, computed with torch: stored * scale (per block for "block")."""
    import torch

    w = q.to(torch.float32)
    if scheme != "block":
        return w * scale
    b = 32
    return w * scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:w.shape[0], :w.shape[1]]


def to_fp8_format(src: str, dst: str, scheme: str, values_dst: str | None = None) -> None:
    """Copy the directory at `src` to `dst` with every projection stored in `scheme`'s format; and to
    `values_dst`, when given, a plain f32 directory holding the values those FP8 tensors stand for."""
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    if values_dst is not None:
        os.makedirs(values_dst)
        for name in os.listdir(src):
            if not name.endswith(".safetensors") and os.path.isfile(os.path.join(src, name)):
                with open(os.path.join(src, name), "rb") as f, open(os.path.join(values_dst, name), "wb") as g:
                    g.write(f.read())
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            out, values = {}, {}
            for key, value in tensors.items():
                if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS:
                    q, scale, scale_name = _quantize(value.to(torch.float32), scheme)
                    out[key] = q
                    out[key.removesuffix("weight") + scale_name] = scale
                    values[key] = _values(q, scale, scheme).contiguous()
                    if scheme == "tensor":  # a static activation scale, as FP8 (static) checkpoints carry
                        out[key.removesuffix("weight") + "input_scale"] = torch.ones(1)
                else:
                    out[key] = values[key] = value
            save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
            if values_dst is not None:
                save_file(values, os.path.join(values_dst, name), metadata={"format": "pt"})
        elif name == "model.safetensors.index.json":
            with open(path, encoding="utf-8") as f:
                index = json.load(f)
            extra = {}
            for key, file in index["weight_map"].items():
                if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS:
                    stem = key.removesuffix("weight")
                    extra[stem + ("weight_scale_inv" if scheme == "block" else "weight_scale")] = file
                    if scheme == "tensor":
                        extra[stem + "input_scale"] = file
            index["weight_map"].update(extra)
            with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
                json.dump(index, f)
        elif name == "config.json":
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            config["quantization_config"] = QUANT_CONFIGS[scheme]
            with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
                json.dump(config, f)
        elif os.path.isfile(path):
            with open(path, "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    write_hf_dir(directory, "llama", seed=2)
    return directory


def greedy(model: str, **overrides) -> dict:
    engine = tiny_engine(model, dtype="float32", max_num_batched_tokens=64, **overrides)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), request_id=str(i))
    return drain(engine)


@pytest.mark.parametrize("scheme", list(QUANT_CONFIGS))
def test_fp8_checkpoint_reads_its_values_and_serves_them_as_fp8(original, tmp_path, scheme):
    fp8_dir, values_dir = str(tmp_path / scheme), str(tmp_path / f"{scheme}_values")
    to_fp8_format(original, fp8_dir, scheme, values_dir)
    assert read_model_config(fp8_dir).quantization is Quantization.FP8  # read from config.json
    assert read_model_config(values_dir).quantization is None
    _, read = load_hf_directory(fp8_dir, "float32")
    _, values = load_hf_directory(values_dir, "float32")
    _, plain = load_hf_directory(original, "float32")
    for block, name in (("attn", "q"), ("attn", "o"), ("mlp", "gate"), ("mlp", "down")):
        got, want = read["layers"][block][name]["kernel"], values["layers"][block][name]["kernel"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)  # stored * scale, as torch computes it
        p = plain["layers"][block][name]["kernel"]
        assert np.linalg.norm(got - p) / np.linalg.norm(p) < 0.04  # the weights, to e4m3's precision
    # Served as FP8 without asking: the same tokens as those values quantized at load.
    assert greedy(fp8_dir) == greedy(values_dir, quantization=Quantization.FP8)


def test_per_channel_checkpoint_serves_the_tokens_of_quantizing_the_original(original, tmp_path):
    fp8_dir = str(tmp_path / "channel")
    to_fp8_format(original, fp8_dir, "channel")
    assert greedy(fp8_dir) == greedy(original, quantization=Quantization.FP8)


@pytest.mark.parametrize("quantize_lm_head", [True, False])
def test_an_fp8_checkpoint_s_16_bit_head_is_quantized_at_load_unless_kept(original, tmp_path, quantize_lm_head):
    """Published FP8 checkpoints keep lm_head in 16 bits ("ignore": ["lm_head"]); served, it is stored as
    e4m3 like the projections (quantize_lm_head), or kept in the model's dtype."""
    fp8_dir = str(tmp_path / "channel")
    to_fp8_format(original, fp8_dir, "channel")
    head = tiny_engine(fp8_dir, dtype="float32", quantize_lm_head=quantize_lm_head).runner.stages[-1].params["lm_head"]
    if quantize_lm_head:
        assert head["weight"].dtype == np.dtype("float8_e4m3fn") and head["weight_scale"].dtype == np.float32
    else:
        assert head.dtype == np.float32 and head.ndim == 2  # [H, V], as read


def test_per_channel_checkpoint_comes_back_to_its_own_values(original, tmp_path):
    """A per-channel checkpoint re-quantized per channel keeps the e4m3 values it stored."""
    import jax.numpy as jnp
    from orca_jax.models import fp8

    fp8_dir = str(tmp_path / "channel")
    to_fp8_format(original, fp8_dir, "channel")
    _, values = load_hf_directory(fp8_dir, "float32")
    kernel = values["layers"]["mlp"]["down"]["kernel"][0]  # [F, H] values read from e4m3 * scale
    stored = fp8.quantize(jnp.asarray(kernel), num_in=1)
    np.testing.assert_allclose(np.asarray(fp8.dequantize(stored["weight"], stored["weight_scale"], jnp.float32)),
                               kernel, rtol=1e-6)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}, "8-bit float"),
])
def test_unsupported_quantization_is_refused_naming_the_field(original, tmp_path, quant, message):
    directory = str(tmp_path / "bad")
    to_fp8_format(original, directory, "channel")
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quant
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(WeightsError, match=message):
        load_model(directory)
