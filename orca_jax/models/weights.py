"""Weights from files into our params pytree: GGUF (Llama) and our own orbax checkpoints.

(Hugging Face directories: hf_checkpoint.py and safetensors_io.py.)

Every loader returns numpy arrays in the config's dtype, in the stacked layout that
`decoder.stacked_param_shapes` says (per-layer weights stacked on a leading [L] axis, einsum layouts),
and checks every shape on the way; the runner unstacks them per layer on the way to the device.
Anything missing, truncated or mismatched raises WeightsError naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from orca_jax.config import Quantization, ModelConfig, ModelFamily, RopeScaling
from orca_jax.models import decoder

Params = dict  # nested dict of np.ndarray, the Decoder's "params" collection


class WeightsError(ValueError):
    """A weights file is missing, truncated, of the wrong kind, or does not fit the config."""


# --- shared helpers ------------------------------------------------------------------------------

def expected_shapes(config: ModelConfig) -> dict:
    """The stacked params pytree as nested dicts of shape tuples."""
    shapes = decoder.stacked_param_shapes(config)
    return jax.tree_util.tree_map(lambda s: tuple(s.shape), shapes)


def check_params(params: Params, config: ModelConfig, source: str) -> None:
    """Raise WeightsError unless `params` has exactly the tree and shapes `config` implies."""
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        expected_shapes(config), is_leaf=lambda x: isinstance(x, tuple))}
    got = {jax.tree_util.keystr(k): tuple(np.shape(v))
           for k, v in jax.tree_util.tree_leaves_with_path(params)}
    if want.keys() != got.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        raise WeightsError(f"{source}: params do not fit the model config "
                           f"(missing {missing or 'none'}, unexpected {extra or 'none'})")
    for name, shape in want.items():
        if got[name] != shape:
            raise WeightsError(f"{source}: {name} has shape {got[name]}, the config needs {shape}")


def cast_params(params: Params, dtype: str) -> Params:
    """Every leaf as a numpy array of `dtype` (one of config.DTYPES)."""
    target = np.dtype(jax.numpy.dtype(dtype))
    return jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=target), params)


def config_to_json(config: ModelConfig) -> str:
    fields = dataclasses.asdict(config)
    fields["family"] = config.family.value
    # The weights saved are the model's own; the KV pages' dtype is the serving engine's choice.
    fields["quantization"] = None if config.quantization is None else config.quantization.value
    del fields["kv_cache_dtype"]
    return json.dumps(fields, indent=2)


def config_from_json(text: str, source: str) -> ModelConfig:
    try:
        fields = json.loads(text)
        fields["family"] = ModelFamily(fields["family"])
        if fields.get("quantization") is not None:
            fields["quantization"] = Quantization(fields["quantization"])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return ModelConfig(**fields)
    except (ValueError, KeyError, TypeError) as err:
        raise WeightsError(f"{source}: not a valid model config ({err})") from err


def _require_file(path: str) -> None:
    if not os.path.exists(path):
        raise WeightsError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: not a regular file")


def _float32_value(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Take float32's shortest repr.
    return float(str(np.float32(value)))


# --- GGUF (llama.cpp) ----------------------------------------------------------------------------

def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path`, with truncation and wrong file types reported clearly."""
    from gguf import GGUFReader  # local: only GGUF users pay for the import

    _require_file(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise WeightsError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises whatever numpy/struct raise on a short file
        raise WeightsError(f"{path}: cannot parse GGUF, the file is truncated or corrupt ({err})") from err
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise WeightsError(f"{path}: tensor {tensor.name} runs past the end of the file "
                               f"({size} bytes): the file is truncated")
    return reader


def _gguf_field(reader, key: str, path: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise WeightsError(f"{path}: GGUF metadata has no {key}")
        return default
    return field.contents()


def config_from_gguf(reader, path: str, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig a Llama-architecture GGUF describes."""
    arch = _gguf_field(reader, "general.architecture", path)
    if arch != "llama":
        raise WeightsError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    def meta(key, default=None):
        return _gguf_field(reader, f"llama.{key}", path, default)

    hidden, num_heads = meta("embedding_length"), meta("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelConfig(
        family=ModelFamily.LLAMA,
        vocab_size=meta("vocab_size", len(tokens.data) if tokens is not None else None),
        hidden_size=hidden, num_layers=meta("block_count"), num_heads=num_heads,
        num_kv_heads=meta("attention.head_count_kv", num_heads),
        head_dim=meta("attention.key_length", hidden // num_heads), ffn_size=meta("feed_forward_length"),
        max_seq_len=meta("context_length"),
        norm_eps=_float32_value(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(meta("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in tensor_names, dtype=dtype,
        bos_token_id=None if bos is None else bos.contents(),
        eos_token_ids=() if eos is None else (eos.contents(),))


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation ([out, in]), back to HF's rotate-half layout.

    llama.cpp interleaves the two halves of each head's rows for its rotate-pairs RoPE; this is the
    inverse transformers applies (`_reverse_permute_weights`).
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf_params(path: str, config: ModelConfig, reader=None) -> Params:
    """Dequantize a Llama GGUF's tensors into our pytree (numpy, config.dtype)."""
    from gguf import dequantize

    reader = reader if reader is not None else open_gguf(path)
    dtype = np.dtype(jax.numpy.dtype(config.dtype))
    params = jax.tree_util.tree_map(lambda s: np.empty(s, dtype), expected_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    layouts = _gguf_layouts(config)
    seen = set()
    for tensor in reader.tensors:
        name = tensor.name
        layer, suffix = _split_layer(name)
        if suffix not in layouts or (layer is not None and layer >= config.num_layers):
            raise WeightsError(f"{path}: unexpected tensor {name} for a {config.num_layers}-layer "
                               f"{'tied' if config.tie_embeddings else 'untied'} Llama")
        where, raw_shape, convert = layouts[suffix]
        if tuple(int(x) for x in reversed(tensor.shape)) != raw_shape:  # ggml lists dims innermost first
            raise WeightsError(f"{path}: {name} gives shape {tuple(reversed(tensor.shape.tolist()))}, "
                               f"the config needs {raw_shape}")
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)  # [out, in]
        except Exception as err:  # gguf raises NotImplementedError, ValueError, ...
            raise WeightsError(f"{path}: cannot dequantize {name} ({tensor.tensor_type.name}): {err}") from err
        holder = params
        for key in where[:-1]:
            holder = holder[key]
        if layer is None:
            holder[where[-1]][...] = convert(weight)
        else:
            holder[where[-1]][layer] = convert(weight)
        seen.add(name)
    expected = {suffix if not suffix.startswith("blk.") else suffix.replace("blk.", f"blk.{i}.", 1)
                for suffix in layouts for i in range(config.num_layers)}
    if missing := sorted(expected - seen, key=_natural_order):
        raise WeightsError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return params


def _gguf_layouts(config: ModelConfig) -> dict:
    """GGUF name (blk.* per layer) -> (path in our tree, [out, in] shape in the file, converter)."""
    h, n, k, d, f, v = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                        config.ffn_size, config.vocab_size)
    same = lambda w: w  # noqa: E731
    layouts = {
        "token_embd.weight": (("embed",), (v, h), same),  # [V, H]
        "output_norm.weight": (("final_norm", "scale"), (h,), same),
        "blk.attn_norm.weight": (("layers", "attn_norm", "scale"), (h,), same),
        "blk.ffn_norm.weight": (("layers", "mlp_norm", "scale"), (h,), same),
        "blk.attn_q.weight": (("layers", "attn", "q", "kernel"), (n * d, h),
                              lambda w: _unpermute_rows(w, n).T.reshape(h, n, d)),
        "blk.attn_k.weight": (("layers", "attn", "k", "kernel"), (k * d, h),
                              lambda w: _unpermute_rows(w, k).T.reshape(h, k, d)),
        "blk.attn_v.weight": (("layers", "attn", "v", "kernel"), (k * d, h), lambda w: w.T.reshape(h, k, d)),
        "blk.attn_output.weight": (("layers", "attn", "o", "kernel"), (h, n * d),
                                   lambda w: w.T.reshape(n, d, h)),
        "blk.ffn_gate.weight": (("layers", "mlp", "gate", "kernel"), (f, h), lambda w: w.T),
        "blk.ffn_up.weight": (("layers", "mlp", "up", "kernel"), (f, h), lambda w: w.T),
        "blk.ffn_down.weight": (("layers", "mlp", "down", "kernel"), (h, f), lambda w: w.T),
    }
    if not config.tie_embeddings:
        layouts["output.weight"] = (("lm_head",), (v, h), lambda w: w.T)  # [H, V]
    return layouts


def _split_layer(name: str) -> tuple[int | None, str]:
    """'blk.7.attn_q.weight' -> (7, 'blk.attn_q.weight'); other names -> (None, name)."""
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
        return int(parts[1]), f"blk.{parts[2]}"
    return None, name


def _natural_order(name: str):
    layer, suffix = _split_layer(name)
    return (-1 if layer is None else layer, suffix)


# --- our own checkpoints (orbax) ------------------------------------------------------------------

def save_params(path: str, params: Params) -> None:
    """Write a params pytree with orbax, in the stacked layout (path must not exist yet)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if os.path.exists(path):
        raise WeightsError(f"{path}: already exists; refusing to overwrite a checkpoint")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, jax.tree_util.tree_map(np.asarray, decoder.stack_layers(params)))
    checkpointer.wait_until_finished()


def restore_params(path: str, config: ModelConfig) -> Params:
    """Read a params pytree saved by save_params, checked against the config's shapes."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise WeightsError(f"{path}: no such checkpoint directory")
    checkpointer = ocp.StandardCheckpointer()
    try:
        # Restore what was saved (orbax restores the saved shapes whatever the target says), then check.
        restored = checkpointer.restore(path)
    except Exception as err:  # orbax raises many types for a broken directory
        raise WeightsError(f"{path}: cannot restore the orbax checkpoint ({err})") from err
    restored = jax.tree_util.tree_map(np.asarray, restored)
    check_params(restored, config, path)
    return cast_params(restored, config.dtype)
