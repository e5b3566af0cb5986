"""Hugging Face Llama-family directories: config.json -> ModelConfig, safetensors -> our params tree.

Llama 2/3 (LlamaForCausalLM, Llama 3.1's "llama3" RoPE scaling), Mistral and Qwen2 (q/k/v biases).
Tensors are read one at a time with `safe_open` straight into preallocated stacked arrays, so the
host holds the model once plus one tensor in flight. Every name and shape is checked against the
config before its data is read; anything unexpected raises WeightsError naming the file and tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Callable

import jax
import numpy as np

from orca_jax.config import ModelConfig, ModelFamily, RopeScaling
from orca_jax.models.weights import Params, WeightsError, check_params, expected_shapes

log = logging.getLogger(__name__)

# model_type -> the one architecture we run for it.
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",) + tuple(LLAMA_FAMILY.values())

# Buffers some older checkpoints carry; we recompute them.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def read_hf_config(path: str) -> dict:
    """config.json as a dict, with its architecture checked against what we can run."""
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: cannot read JSON ({err})") from err
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if model_type not in (*LLAMA_FAMILY, "gpt2") or unsupported:
        found = ", ".join(architectures) or f"model_type {model_type!r}"
        raise WeightsError(f"{path}: architecture {found} is not supported "
                           f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return hf


def _rope(hf: dict, path: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x checkpoints "rope_theta" + "rope_scaling".
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise WeightsError(f"{path}: rope scaling {kind!r} is not supported (only 'llama3' and none)")
    try:
        return theta, RopeScaling(factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position=int(params["original_max_position_embeddings"]))
    except (KeyError, ValueError) as err:
        raise WeightsError(f"{path}: incomplete llama3 rope scaling {params} ({err!r})") from err


def _max_seq_len(hf: dict, path: str) -> int:
    max_len = hf["max_position_embeddings"]
    window = hf.get("sliding_window")
    if hf["model_type"] == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if window is not None and window < max_len:
        # Within the window sliding-window attention is plain causal attention, so capping the
        # context there is exact; beyond it we would need a windowed kernel we do not have.
        log.warning("%s: sliding_window %d < max_position_embeddings %d: serving at most %d tokens",
                    path, window, max_len, window)
        return window
    return max_len


def config_from_llama_json(path: str, dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a Llama, Mistral or Qwen2 config.json; variants we cannot run exactly are refused."""
    hf = read_hf_config(path)
    model_type = hf["model_type"]
    if model_type not in LLAMA_FAMILY:
        raise WeightsError(f"{path}: model_type {model_type!r} is not a Llama-family model")
    if hf.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    for flag in ("attention_bias", "mlp_bias"):  # Llama's flags bias o_proj / the MLP too
        if hf.get(flag):
            raise WeightsError(f"{path}: {flag}=true is not supported")
    if hf.get("pretraining_tp", 1) != 1:
        raise WeightsError(f"{path}: pretraining_tp={hf['pretraining_tp']} is not supported")
    theta, scaling = _rope(hf, path)
    eos = _eos_ids(hf.get("eos_token_id"))
    # generation_config.json often lists more stop ids than config.json (Llama 3 Instruct's <|eot_id|>).
    generation = os.path.join(os.path.dirname(path), "generation_config.json")
    if os.path.isfile(generation):
        try:
            with open(generation, encoding="utf-8") as f:
                eos = tuple(dict.fromkeys(eos + _eos_ids(json.load(f).get("eos_token_id"))))
        except (OSError, json.JSONDecodeError) as err:
            raise WeightsError(f"{generation}: cannot read JSON ({err})") from err
    try:
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        return ModelConfig(
            family=ModelFamily.LLAMA, vocab_size=hf["vocab_size"], hidden_size=hidden,
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads, ffn_size=hf["intermediate_size"],
            max_seq_len=_max_seq_len(hf, path), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, qkv_bias=model_type == "qwen2",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype or "float32",
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos)
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsError(f"{path}: not a usable {model_type} config ({err!r})") from err


def _eos_ids(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


class SafetensorsDirectory:
    """The tensors of model.safetensors or of a sharded index, opened lazily, read one at a time."""

    def __init__(self, directory: str):
        single = os.path.join(directory, "model.safetensors")
        index = os.path.join(directory, "model.safetensors.index.json")
        self.source = index if os.path.isfile(index) else single
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as err:
                raise WeightsError(f"{index}: not a safetensors index ({err!r})") from err
            self.files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        else:
            self.files = {name: single for name in self._open(single).keys()}

    def __enter__(self) -> "SafetensorsDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            if not os.path.isfile(file):
                raise WeightsError(f"{file}: no such file (listed in {self.source})")
            try:
                # The "flax" framework reads every dtype numpy lacks (bf16); pinned to the host CPU.
                self._handles[file] = self._stack.enter_context(safe_open(file, framework="flax", device="cpu"))
            except (SafetensorError, OSError, ValueError) as err:
                raise WeightsError(f"{file}: cannot read safetensors, truncated or corrupt ({err})") from err
        return self._handles[file]

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as a numpy array, after checking that it has `shape`."""
        from safetensors import SafetensorError

        if name not in self.files:
            raise WeightsError(f"{self.source}: missing tensor {name} (expected shape {shape})")
        file = self.files[name]
        handle = self._open(file)
        if name not in handle.keys():
            raise WeightsError(f"{file}: missing tensor {name} (expected shape {shape}; "
                               f"{os.path.basename(self.source)} says it is here)")
        found = tuple(handle.get_slice(name).get_shape())
        if found != shape:
            raise WeightsError(f"{file}: tensor {name} has shape {found}, config.json implies {shape}")
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(handle.get_tensor(name))
        except (SafetensorError, OSError, ValueError) as err:
            raise WeightsError(f"{file}: cannot read tensor {name} ({err})") from err


def _layouts(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], Callable]]:
    """HF name ('{i}' for the layer) -> (path in our tree, shape in the file, converter to our layout)."""
    h, n, k, d, f, v = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                        config.ffn_size, config.vocab_size)
    attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    same = lambda w: w  # noqa: E731
    # torch Linear weights are [out, in]; our kernels are einsum layouts over [in, ...out].
    layouts = {
        "model.embed_tokens.weight": (("embed",), (v, h), same),  # [V, H]
        "model.norm.weight": (("final_norm", "scale"), (h,), same),
        "model.layers.{i}.input_layernorm.weight": (("layers", "attn_norm", "scale"), (h,), same),
        "model.layers.{i}.post_attention_layernorm.weight": (("layers", "mlp_norm", "scale"), (h,), same),
        f"{attn}.q_proj.weight": (("layers", "attn", "q", "kernel"), (n * d, h), lambda w: w.T.reshape(h, n, d)),
        f"{attn}.k_proj.weight": (("layers", "attn", "k", "kernel"), (k * d, h), lambda w: w.T.reshape(h, k, d)),
        f"{attn}.v_proj.weight": (("layers", "attn", "v", "kernel"), (k * d, h), lambda w: w.T.reshape(h, k, d)),
        f"{attn}.o_proj.weight": (("layers", "attn", "o", "kernel"), (h, n * d), lambda w: w.T.reshape(n, d, h)),
        f"{mlp}.gate_proj.weight": (("layers", "mlp", "gate", "kernel"), (f, h), lambda w: w.T),
        f"{mlp}.up_proj.weight": (("layers", "mlp", "up", "kernel"), (f, h), lambda w: w.T),
        f"{mlp}.down_proj.weight": (("layers", "mlp", "down", "kernel"), (h, f), lambda w: w.T),
    }
    if config.qkv_bias:
        for part, heads in (("q", n), ("k", k), ("v", k)):
            layouts[f"{attn}.{part}_proj.bias"] = (("layers", "attn", part, "bias"), (heads * d,),
                                                   lambda b, heads=heads: b.reshape(heads, d))
    if not config.tie_embeddings:
        layouts["lm_head.weight"] = (("lm_head",), (v, h), lambda w: w.T)  # [H, V]
    return layouts


def load_llama_params(directory: str, config: ModelConfig) -> Params:
    """Our params tree (numpy, config.dtype, layers stacked on a leading [L] axis) from safetensors."""
    dtype = np.dtype(jax.numpy.dtype(config.dtype))
    params = jax.tree_util.tree_map(lambda s: np.empty(s, dtype), expected_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    layouts = _layouts(config)
    with SafetensorsDirectory(directory) as tensors:
        wanted = {name.format(i=i) for name in layouts for i in range(config.num_layers)}
        ignorable = {"lm_head.weight"} if config.tie_embeddings else set()  # some tied files keep a copy
        unexpected = sorted(name for name in tensors.files
                            if name not in wanted and name not in ignorable and not _IGNORED.fullmatch(name))
        if unexpected:
            raise WeightsError(f"{tensors.files[unexpected[0]]}: unexpected tensor {unexpected[0]} for a "
                               f"{config.num_layers}-layer {'tied' if config.tie_embeddings else 'untied'} "
                               f"model{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}")
        for template, (where, shape, convert) in layouts.items():
            holder = params
            for key in where[:-1]:
                holder = holder[key]
            if "{i}" not in template:
                holder[where[-1]][...] = convert(tensors.read(template, shape))
                continue
            for i in range(config.num_layers):
                holder[where[-1]][i] = convert(tensors.read(template.format(i=i), shape))
        check_params(params, config, tensors.source)
    return params
