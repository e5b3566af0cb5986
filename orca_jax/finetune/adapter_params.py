"""The adapter a job trains, kept in peft's own layout, and saved or read as a peft directory (no jax).

The trained tree is {"layers": [{module key: {"a": f32[r, in], "b": f32[out, r]}}]}: per layer, per
adapted peft module (hparams.LLAMA_MODULES / GPT2_MODULES), torch's lora_A and lora_B weights, unscaled.
Kept this way so that the optimizer sees exactly the parameters peft trains (AdamW's step depends on
how they are scaled), a checkpoint is a peft directory as is, and GPT-2's c_attn keeps its one A for
q, k and v. The forward turns each layer into the model layout (`model_layout`, B scaled) and then
into a one-slot adapter table (lora/layout.py), so training runs the served adapter term itself.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from orca_jax.config import ModelConfig, ModelFamily
from orca_jax.finetune.hparams import LoRASpec, family_modules
from orca_jax.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAError, projection_shapes, read_adapter_config
from orca_jax.models.safetensors_io import SafetensorsFile
from orca_jax.models.weights import WeightsError


def module_shapes(config: ModelConfig, modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(in, out) widths of each module's lora_A [r, in] and lora_B [out, r]."""
    shapes = projection_shapes(config)
    parts = family_modules(config.family)
    return {key: (math.prod(shapes[parts[key][0]][0]), sum(math.prod(shapes[p][1]) for p in parts[key]))
            for key in modules}


def init_adapter(config: ModelConfig, spec: LoRASpec, seed: int) -> dict:
    """peft's initialisation: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0,
    so the adapter starts as the base model."""
    rng = np.random.default_rng(seed)
    widths = module_shapes(config, spec.target_modules)
    layers = []
    for _ in range(config.num_layers):
        layer = {}
        for key, (fan_in, fan_out) in widths.items():
            bound = 1.0 / math.sqrt(fan_in)
            layer[key] = {"a": rng.uniform(-bound, bound, (spec.rank, fan_in)).astype(np.float32),
                          "b": np.zeros((fan_out, spec.rank), np.float32)}
        layers.append(layer)
    return {"layers": layers}


def model_layout(layer: dict, config: ModelConfig, scaling: float, xp=np) -> dict:
    """One trained layer -> {projection: (a [*in, r], b [r, *out])} with the scaling in b, the layout
    adapter.LoRAAdapter and lora/layout.slot_layer take. `xp`: numpy or jax.numpy."""
    shapes = projection_shapes(config)
    parts_of = family_modules(config.family)
    out = {}
    for key, weights in layer.items():
        a, b = weights["a"], weights["b"]  # [r, in], [out, r]
        rank = a.shape[0]
        parts = parts_of[key]
        a_model = a.T.reshape(*shapes[parts[0]][0], rank)
        b_all = b.T * scaling  # [r, out]
        offset = 0
        for part in parts:
            size = math.prod(shapes[part][1])
            out[part] = (a_model, b_all[:, offset:offset + size].reshape(rank, *shapes[part][1]))
            offset += size
    return out


def _layer_prefix(family: ModelFamily, index: int) -> str:
    return f"model.layers.{index}." if family is ModelFamily.LLAMA else f"transformer.h.{index}."


def save_peft(directory: str, params: dict, spec: LoRASpec, config: ModelConfig, base_model: str) -> None:
    """Write adapter_config.json and adapter_model.safetensors as peft's save_pretrained does, so
    peft, transformers and our adapter loader (lora/adapter.py) all read it."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for i, layer in enumerate(params["layers"]):
        for key, weights in layer.items():
            name = f"base_model.model.{_layer_prefix(config.family, i)}{key}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(weights["a"], np.float32)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(weights["b"], np.float32)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "use_rslora": spec.use_rslora, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": config.family is ModelFamily.GPT, "inference_mode": True,
        "target_modules": sorted({key.rsplit(".", 1)[-1] if config.family is ModelFamily.LLAMA else key
                                  for key in spec.target_modules}),
    }
    tmp = os.path.join(directory, WEIGHTS_FILE + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)


def read_peft(directory: str, name: str, config: ModelConfig) -> tuple[dict, LoRASpec]:
    """A peft directory as a trainable tree and its spec, to continue training it (LoRAError if it has
    a rank_pattern or alpha_pattern, which one spec cannot hold, or does not fit `config`)."""
    adapter_config = read_adapter_config(directory, name)
    if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"):
        raise LoRAError(f"LoRA adapter {name!r}: per-module ranks or alphas cannot be trained further")
    rank = int(adapter_config["r"])
    try:
        file = SafetensorsFile(os.path.join(directory, WEIGHTS_FILE))
        tensors = {tensor: file.read(tensor) for tensor in file.entries}
    except (WeightsError, OSError) as err:
        raise LoRAError(f"LoRA adapter {name!r}: {err}") from None
    keys = set()
    layers = []
    for i in range(config.num_layers):
        layer = {}
        for key in family_modules(config.family):
            stem = f"base_model.model.{_layer_prefix(config.family, i)}{key}"
            if f"{stem}.lora_A.weight" in tensors:
                layer[key] = {"a": tensors.pop(f"{stem}.lora_A.weight").astype(np.float32),
                              "b": tensors.pop(f"{stem}.lora_B.weight").astype(np.float32)}
                keys.add(key)
        layers.append(layer)
    if tensors or not keys:  # the names are not echoed: the directory may hold any safetensors file
        raise LoRAError(f"LoRA adapter {name!r}: {len(tensors) or 'no'} tensors this {config.family.value} model "
                        "cannot train")
    modules = tuple(key for key in family_modules(config.family) if key in keys)
    widths = module_shapes(config, modules)
    for layer in layers:
        if set(layer) != set(modules):
            raise LoRAError(f"LoRA adapter {name!r}: not every layer adapts the same modules")
        for key, weights in layer.items():
            if weights["a"].shape != (rank, widths[key][0]) or weights["b"].shape != (widths[key][1], rank):
                raise LoRAError(f"LoRA adapter {name!r}: {key} does not fit the base model")
            if not (np.isfinite(weights["a"]).all() and np.isfinite(weights["b"]).all()):
                raise LoRAError(f"LoRA adapter {name!r}: {key}'s weights must be finite; they hold NaN or "
                                "infinite values")
    spec = LoRASpec(rank, float(adapter_config["lora_alpha"]), modules, bool(adapter_config.get("use_rslora")))
    return {"layers": layers}, spec
