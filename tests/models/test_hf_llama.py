"""Hugging Face Llama-family directories (Llama, Llama 3.1 rope scaling, Qwen2, Mistral) against transformers.

Each model is written by transformers' save_pretrained, sharded into several safetensors files, and
loaded by us from the directory alone (weights, config, tokenizer, chat template).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from orca_jax.config import RopeScaling
from orca_jax.models.decoder import rope_inv_freq
from orca_jax.models.loader import LoadedModel, load_model
from orca_jax.models.weights import WeightsError
from orca_jax.sampling_params import SamplingParams

from tests.helpers.hf_dirs import KINDS, write_hf_dir
from tests.helpers.models import hf_greedy, hf_logits, hf_offline, our_engine, our_greedy, our_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_offline()

# Max |ours - transformers| over 40 positions x 320 logits, fp32 on CPU, |logits| <= ~1.
# Measured: at most 1.1e-6 for all four families (40 and 200 positions).
LOGIT_BOUND = 1e-5

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me a joke."}],
]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """build(kind) -> (kind, transformers model, our LoadedModel, directory), written once per module."""
    built = {}

    def get(kind: str):
        if kind not in built:
            directory = str(tmp_path_factory.mktemp(kind))
            theirs = write_hf_dir(directory, kind)
            built[kind] = (kind, theirs, load_model(directory), directory)
        return built[kind]

    return get


@pytest.fixture(params=list(KINDS))
def pair(request, build):
    return build(request.param)


def test_directory_is_sharded(pair):
    _, _, _, directory = pair
    shards = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert len(shards) >= 3 and os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))


def test_config(pair):
    kind, theirs, ours, _ = pair
    config = ours.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.ffn_size) == (2, 64, 4, 2, 16, 96)
    assert config.qkv_bias == (kind == "qwen2")
    assert (config.rope_scaling is not None) == (kind == "llama3-rope")
    assert config.tie_embeddings == theirs.config.tie_word_embeddings
    assert config.eos_token_ids == (theirs.config.eos_token_id,) == ours.tokenizer.eos_token_ids
    assert ours.tokenizer.bos_token_id == theirs.config.bos_token_id


def test_logits_match(pair):
    _, theirs, ours, _ = pair
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, size=40).tolist()
    diff = np.abs(our_logits(ours, ids) - hf_logits(theirs, ids)).max()
    assert diff < LOGIT_BOUND, diff


def test_greedy_matches(pair):
    _, theirs, ours, _ = pair
    ids = ours.tokenizer.encode("Once upon a time there was")
    assert our_greedy(ours, ids, 20) == hf_greedy(theirs, ids, 20, ours.config.eos_token_ids)


def test_a_text_prompt_is_encoded_like_transformers_with_its_bos(pair):
    # Completion prompts as the engine and the server take them (chat prompts take BOS from the template).
    kind, theirs_model, ours, directory = pair
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    text = "Once upon a time there was"
    expected = theirs(text).input_ids
    assert ours.tokenizer.encode_prompt(text) == expected
    assert (expected[0] == ours.tokenizer.bos_token_id) == (KINDS[kind][4] is not None)  # qwen2 has no BOS
    engine = our_engine(ours)
    engine.add_request(text, SamplingParams(max_tokens=1))
    (first,) = engine.step() or engine.step()
    assert first.num_prompt_tokens == len(expected)


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "three-turns"])
def test_chat_template_renders_like_transformers(pair, chat):
    _, _, ours, directory = pair
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for add_generation_prompt in (True, False):
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        text = ours.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        assert text == expected
        assert ours.tokenizer.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_rope_scaling_matters(build):
    # The llama3 parity above could pass by accident only if scaling changed nothing at these positions.
    _, theirs, ours, _ = build("llama3-rope")
    unscaled = LoadedModel(dataclasses.replace(ours.config, rope_scaling=None), ours.params, ours.tokenizer)
    ids = np.random.default_rng(1).integers(0, 320, size=40).tolist()
    assert np.abs(our_logits(unscaled, ids) - hf_logits(theirs, ids)).max() > 100 * LOGIT_BOUND


def test_rope_inv_freq_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=0)
    assert not np.allclose(ours, rope_inv_freq(128, 500000.0))  # Llama 3.1's real numbers do scale


def test_llm_generates_like_transformers(build):
    # The whole engine (runner, sharding rules, paged KV) on a directory, not just the decoder; Qwen2
    # for its extra bias params.
    from orca_jax import LLM, SamplingParams

    _, theirs, ours, directory = build("qwen2")
    llm = LLM(directory, max_num_seqs=2, num_kv_pages=64, page_size=8, max_num_batched_tokens=64)
    prompt = ours.tokenizer.apply_chat_template(CHATS[0])
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    ids = ours.tokenizer.encode(prompt)
    assert out.token_ids == hf_greedy(theirs, ids, 12, ours.config.eos_token_ids)


# --- what is refused, and how ---------------------------------------------------------------------

@pytest.fixture
def llama_copy(tmp_path, build):
    directory = build("llama")[3]
    target = tmp_path / "llama"
    shutil.copytree(directory, target)
    return target


def _rewrite_tensor(directory, name: str, change) -> str:
    """Apply `change` to the tensor dict of the shard holding `name`; returns the shard's file name."""
    from safetensors.numpy import load_file, save_file

    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map[name]
    tensors = load_file(str(directory / shard))
    change(tensors)
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    return shard


def test_unknown_architecture_is_named(llama_copy):
    path = llama_copy / "config.json"
    hf = json.loads(path.read_text())
    path.write_text(json.dumps({**hf, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(WeightsError, match=r"config.json: architecture GemmaForCausalLM is not supported"):
        load_model(str(llama_copy))


def test_unsupported_rope_scaling_is_refused(llama_copy):
    path = llama_copy / "config.json"
    hf = json.loads(path.read_text())
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    path.write_text(json.dumps(hf))
    with pytest.raises(WeightsError, match=r"config.json: rope scaling 'yarn' is not supported"):
        load_model(str(llama_copy))


def test_wrong_shape_names_file_tensor_and_shapes(llama_copy):
    name = "model.layers.1.mlp.up_proj.weight"
    shard = _rewrite_tensor(llama_copy, name, lambda t: t.update({name: t[name][:, :32].copy()}))
    with pytest.raises(WeightsError, match=rf"{shard}: tensor {name} has shape \(96, 32\), "
                                           r"config.json implies \(96, 64\)"):
        load_model(str(llama_copy))


def test_missing_tensor_is_named(llama_copy):
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = _rewrite_tensor(llama_copy, name, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=rf"{shard}: missing tensor {name} \(expected shape \(32, 64\)"):
        load_model(str(llama_copy))


def test_tensor_missing_from_the_index_is_named(llama_copy):
    index = llama_copy / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    del content["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(content))
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json: missing tensor model.norm.weight"):
        load_model(str(llama_copy))


def test_extra_layer_is_refused(llama_copy):
    path = llama_copy / "config.json"
    hf = json.loads(path.read_text())
    path.write_text(json.dumps({**hf, "num_hidden_layers": 1}))
    with pytest.raises(WeightsError, match=r"unexpected tensor model.layers.1.\S+ for a 1-layer untied model"):
        load_model(str(llama_copy))


def test_bfloat16_checkpoint(tmp_path):
    # Real checkpoints are bf16: read bit-exactly (numpy itself has no bfloat16).
    # A bf16 checkpoint is served in bf16 unless asked otherwise (vLLM's dtype "auto").
    theirs = write_hf_dir(str(tmp_path), "mistral", torch_dtype=torch.bfloat16)
    half = load_model(str(tmp_path))
    assert half.config.dtype == "bfloat16" and half.params["embed"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(half.params["embed"].astype(np.float32),
                                  theirs.model.embed_tokens.weight.detach().float().numpy())
    full = load_model(str(tmp_path), dtype="float32")
    assert full.config.dtype == "float32"
    want = theirs.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T.reshape(64, 4, 16)
    np.testing.assert_array_equal(full.params["layers"]["attn"]["q"]["kernel"][1], want)


def test_float16_checkpoint_serves_in_float16(tmp_path):
    # --dtype auto keeps the checkpoint's float16: weights bit-exact, activations and KV in fp16.
    # Measured against transformers in fp32 on the same weights: 1.3e-3 (|logits| <= 1.8).
    theirs = write_hf_dir(str(tmp_path), "llama", torch_dtype=torch.float16)
    half = load_model(str(tmp_path))
    assert half.config.dtype == "float16" and half.params["embed"].dtype == np.float16
    np.testing.assert_array_equal(half.params["embed"], theirs.model.embed_tokens.weight.detach().numpy())
    reference = theirs.float()
    ids = list(range(3, 43))
    assert np.abs(our_logits(half, ids) - hf_logits(reference, ids)).max() < 1e-2
    assert our_greedy(half, ids[:8], 12) == hf_greedy(reference, ids[:8], 12, half.config.eos_token_ids)


def test_orbax_round_trip_keeps_the_new_switches(build, tmp_path):
    from orca_jax.models.loader import save_model

    _, _, ours, _ = build("llama3-rope")
    qwen = build("qwen2")[2]
    for loaded, name in ((ours, "llama3"), (qwen, "qwen2")):
        save_model(str(tmp_path / name), loaded.config, loaded.params, loaded.tokenizer)
        again = load_model(str(tmp_path / name))
        assert again.config == loaded.config
        np.testing.assert_array_equal(again.params["layers"]["attn"]["k"]["kernel"],
                                      loaded.params["layers"]["attn"]["k"]["kernel"])


def test_truncated_shard_is_named(llama_copy):
    shard = sorted(p for p in llama_copy.iterdir() if p.suffix == ".safetensors")[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=rf"{shard.name}: cannot read safetensors, truncated or corrupt"):
        load_model(str(llama_copy))


def _write_numpy_llama(directory, hidden=256, ffn=512, layers=2, vocab=4096) -> None:
    """A random untied Llama in two bf16 shards, written without torch (big enough to weigh)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    bf16 = jax.numpy.bfloat16
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes |= {prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
                   prefix + "self_attn.q_proj.weight": (hidden, hidden), prefix + "self_attn.k_proj.weight": (64, hidden),
                   prefix + "self_attn.v_proj.weight": (64, hidden), prefix + "self_attn.o_proj.weight": (hidden, hidden),
                   prefix + "mlp.gate_proj.weight": (ffn, hidden), prefix + "mlp.up_proj.weight": (ffn, hidden),
                   prefix + "mlp.down_proj.weight": (hidden, ffn)}
    names = sorted(shapes)
    weight_map = {}
    for number, part in enumerate((names[::2], names[1::2]), 1):
        file = f"model-{number:05d}-of-00002.safetensors"
        save_file({n: rng.standard_normal(shapes[n], dtype=np.float32).astype(bf16) for n in part},
                  str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 1,
        "vocab_size": vocab, "max_position_embeddings": 128, "tie_word_embeddings": False}))


def test_host_holds_the_model_once(tmp_path):
    # numpy reports its allocations to tracemalloc: the peak while loading is the params tree plus
    # the tensor in flight (read, then converted), never a second copy of the model.
    import tracemalloc

    from orca_jax.models import hf_checkpoint

    _write_numpy_llama(tmp_path)
    tracemalloc.start()
    try:
        _, params = hf_checkpoint.load_hf_directory(str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))  # 12.9 MB, fp32
    largest = max(x.nbytes for x in jax.tree_util.tree_leaves(params))  # 4 MB, each embedding
    # Measured: params + 4.9 MB (a bf16 tensor, its fp32 view and the tracing of the shapes); a second
    # copy of the model would be 2 x params.
    assert params_bytes < peak < params_bytes + 2 * largest < 2 * params_bytes, (peak, params_bytes, largest)


# Llama-3.1-8B-Instruct's config.json and generation_config.json as published (transformers 4.x keys).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 128256}


def test_published_llama31_config(tmp_path):
    from orca_jax.models.hf_checkpoint import config_from_llama_json
    from orca_jax.models.presets import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    config = config_from_llama_json(str(tmp_path / "config.json"))
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and config.rope_theta == 500000.0
    assert config.eos_token_ids == (128001, 128008, 128009) and config.bos_token_id == 128000
    assert config.dtype == "bfloat16" and config.max_seq_len == 131072 and not config.qkv_bias
    # The same shapes as our random-weight preset.
    assert dataclasses.replace(config, rope_scaling=None, max_seq_len=8192,
                               eos_token_ids=(128001,)) == PRESETS["llama-8b"]


@pytest.mark.parametrize("model_type,extra,max_len", [
    ("mistral", {"sliding_window": 4096}, 4096),  # Mistral 7B v0.1: capped at the window (exact there)
    ("mistral", {"sliding_window": None}, 32768),
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, 32768),  # Qwen2 ignores it unless used
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": True}, 4096),
])
def test_sliding_window_caps_the_context(tmp_path, model_type, extra, max_len):
    from orca_jax.models.hf_checkpoint import config_from_llama_json

    hf = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
          "max_position_embeddings": 32768, **extra}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert config_from_llama_json(str(tmp_path / "config.json")).max_seq_len == max_len
