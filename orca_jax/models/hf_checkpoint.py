"""Hugging Face directories: config.json -> ModelConfig, and how their tensors map onto our params tree.

GPT-2 (GPT2LMHeadModel), Llama 2/3 (LlamaForCausalLM, Llama 3.1's "llama3" RoPE scaling), Mistral and
Qwen2 (q/k/v biases). Variants we cannot run exactly are refused, naming config.json and the field.
The tensors are read by safetensors_io.fill_params, one at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re

from orca_jax.config import DTYPES, ModelConfig, ModelFamily, Quantization, RopeScaling
from orca_jax.models.fp8_checkpoint import ignored_in_fp8, scheme_from_config
from orca_jax.models.safetensors_io import Layouts, fill_params
from orca_jax.models.weights import Params, WeightsError

log = logging.getLogger(__name__)

# model_type -> the one architecture we run for it.
LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",) + tuple(LLAMA_FAMILY.values())

# Buffers some checkpoints carry; we recompute them. Tied models may still store lm_head (a copy).
_LLAMA_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_GPT2_IGNORED = re.compile(r"h\.\d+\.attn\.(masked_)?bias")  # the causal mask, in older GPT-2 files


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
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype or checkpoint_dtype(hf),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos, quantization=_quantization(hf, path))
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsError(f"{path}: not a usable {model_type} config ({err!r})") from err


def _quantization(hf: dict, path: str) -> Quantization | None:
    """FP8 for a checkpoint stored in a supported FP8 scheme (fp8_checkpoint.py), None for none; an
    unsupported quantization is refused here, before any weight is read."""
    return None if scheme_from_config(hf, path) is None else Quantization.FP8


def checkpoint_dtype(hf: dict) -> str:
    """The dtype to serve in when none is asked for (--dtype auto): the checkpoint's, or fp32 when it
    names none we know."""
    stored = hf.get("dtype") or hf.get("torch_dtype")  # transformers 5 / 4.x
    return stored if stored in DTYPES else "float32"


def _eos_ids(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def config_from_gpt2_json(path: str, dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a GPT-2 config.json; unsupported variants are refused, not approximated."""
    hf = read_hf_config(path)
    if hf["model_type"] != "gpt2":
        raise WeightsError(f"{path}: model_type {hf['model_type']!r} is not GPT-2")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise WeightsError(f"{path}: activation {hf['activation_function']!r} is not supported (tanh GeLU only)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise WeightsError(f"{path}: {flag}=true is not supported")
    if not hf.get("scale_attn_weights", True):
        raise WeightsError(f"{path}: scale_attn_weights=false is not supported")
    try:
        hidden, heads = hf["n_embd"], hf["n_head"]
        return ModelConfig(
            family=ModelFamily.GPT, vocab_size=hf["vocab_size"], hidden_size=hidden,
            num_layers=hf["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            ffn_size=hf.get("n_inner") or 4 * hidden, max_seq_len=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True), dtype=dtype or checkpoint_dtype(hf),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=_eos_ids(hf.get("eos_token_id")),
            quantization=_quantization(hf, path))
    except (KeyError, TypeError, ValueError) as err:
        raise WeightsError(f"{path}: not a usable GPT-2 config ({err!r})") from err


def _same(w):
    return w


def _llama_layouts(config: ModelConfig) -> Layouts:
    h, n, k, d, f, v = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                        config.ffn_size, config.vocab_size)
    attn, mlp, layer = "model.layers.{i}.self_attn", "model.layers.{i}.mlp", ("layers",)
    # torch Linear weights are [out, in]; our kernels are einsum layouts over [in, ...out].
    layouts = {
        "model.embed_tokens.weight": ((v, h), ((("embed",), _same),)),  # [V, H]
        "model.norm.weight": ((h,), ((("final_norm", "scale"), _same),)),
        "model.layers.{i}.input_layernorm.weight": ((h,), (((*layer, "attn_norm", "scale"), _same),)),
        "model.layers.{i}.post_attention_layernorm.weight": ((h,), (((*layer, "mlp_norm", "scale"), _same),)),
        f"{attn}.q_proj.weight": ((n * d, h), (((*layer, "attn", "q", "kernel"), lambda w: w.T.reshape(h, n, d)),)),
        f"{attn}.k_proj.weight": ((k * d, h), (((*layer, "attn", "k", "kernel"), lambda w: w.T.reshape(h, k, d)),)),
        f"{attn}.v_proj.weight": ((k * d, h), (((*layer, "attn", "v", "kernel"), lambda w: w.T.reshape(h, k, d)),)),
        f"{attn}.o_proj.weight": ((h, n * d), (((*layer, "attn", "o", "kernel"), lambda w: w.T.reshape(n, d, h)),)),
        f"{mlp}.gate_proj.weight": ((f, h), (((*layer, "mlp", "gate", "kernel"), lambda w: w.T),)),
        f"{mlp}.up_proj.weight": ((f, h), (((*layer, "mlp", "up", "kernel"), lambda w: w.T),)),
        f"{mlp}.down_proj.weight": ((h, f), (((*layer, "mlp", "down", "kernel"), lambda w: w.T),)),
    }
    if config.qkv_bias:
        for part, heads in (("q", n), ("k", k), ("v", k)):
            layouts[f"{attn}.{part}_proj.bias"] = (
                (heads * d,), (((*layer, "attn", part, "bias"), lambda b, heads=heads: b.reshape(heads, d)),))
    if not config.tie_embeddings:
        layouts["lm_head.weight"] = ((v, h), ((("lm_head",), lambda w: w.T),))  # [H, V]
    return layouts


def _gpt2_layouts(config: ModelConfig) -> Layouts:
    h, n, d, f, v = config.hidden_size, config.num_heads, config.head_dim, config.ffn_size, config.vocab_size
    layer = ("layers",)
    # GPT-2's Conv1D weights are already [in, out] (x @ W); c_attn holds q, k and v side by side.
    qkv_kernels = tuple(((*layer, "attn", part, "kernel"), lambda w, p=p: w.reshape(h, 3, n, d)[:, p])
                        for p, part in enumerate("qkv"))
    qkv_biases = tuple(((*layer, "attn", part, "bias"), lambda b, p=p: b.reshape(3, n, d)[p])
                       for p, part in enumerate("qkv"))

    def norm(name: str, where: tuple[str, ...]) -> Layouts:
        return {f"{name}.weight": ((h,), (((*where, "scale"), _same),)),
                f"{name}.bias": ((h,), (((*where, "bias"), _same),))}

    layouts = {
        "wte.weight": ((v, h), ((("embed",), _same),)),
        "wpe.weight": ((config.max_seq_len, h), ((("pos_embed",), _same),)),
        **norm("ln_f", ("final_norm",)),
        **norm("h.{i}.ln_1", (*layer, "attn_norm")),
        **norm("h.{i}.ln_2", (*layer, "mlp_norm")),
        "h.{i}.attn.c_attn.weight": ((h, 3 * h), qkv_kernels),
        "h.{i}.attn.c_attn.bias": ((3 * h,), qkv_biases),
        "h.{i}.attn.c_proj.weight": ((h, h), (((*layer, "attn", "o", "kernel"), lambda w: w.reshape(n, d, h)),)),
        "h.{i}.attn.c_proj.bias": ((h,), (((*layer, "attn", "o", "bias"), _same),)),
        "h.{i}.mlp.c_fc.weight": ((h, f), (((*layer, "mlp", "up", "kernel"), _same),)),
        "h.{i}.mlp.c_fc.bias": ((f,), (((*layer, "mlp", "up", "bias"), _same),)),
        "h.{i}.mlp.c_proj.weight": ((f, h), (((*layer, "mlp", "down", "kernel"), _same),)),
        "h.{i}.mlp.c_proj.bias": ((h,), (((*layer, "mlp", "down", "bias"), _same),)),
    }
    if not config.tie_embeddings:
        layouts["lm_head.weight"] = ((v, h), ((("lm_head",), lambda w: w.T),))  # [H, V]
    return layouts


def load_hf_directory(directory: str, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    """Config and params (numpy, layers stacked on a leading [L] axis) of a Hugging Face directory."""
    path = os.path.join(directory, "config.json")
    if read_hf_config(path)["model_type"] == "gpt2":
        config = config_from_gpt2_json(path, dtype)
        layouts, ignored, strip = _gpt2_layouts(config), _GPT2_IGNORED, "transformer."
    else:
        config = config_from_llama_json(path, dtype)
        layouts, ignored, strip = _llama_layouts(config), _LLAMA_IGNORED, ""
    if config.tie_embeddings:  # some tied checkpoints still store the head: a copy of the embedding
        ignored = re.compile(f"{ignored.pattern}|lm_head\\.weight")
    fp8 = scheme_from_config(read_hf_config(path), path)
    if fp8 is not None:
        ignored = ignored_in_fp8(ignored)
    return config, fill_params(directory, config, layouts, ignored, strip, fp8)
