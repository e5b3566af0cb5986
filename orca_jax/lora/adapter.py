"""LoRA adapters as peft saves them, read and checked against the base model (numpy, host; no jax).

A peft directory holds adapter_config.json (rank r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors: per adapted module `base_model.model.<module>.lora_A.weight` [r, in] and
`lora_B.weight` [out, r], the torch Linear layout; peft adds `scaling * B @ A @ x` to the module's
output, scaling = alpha / r (alpha / sqrt(r) with rslora; per module with rank_pattern/alpha_pattern).
Read here into the model layout our params use (q [H] -> [N, D], o [N, D] -> [H], ...), the scaling
folded into B. Llama-family modules q/k/v/o_proj and gate/up/down_proj; GPT-2's c_attn (q|k|v with one
A), attn.c_proj (o), mlp.c_fc (up), mlp.c_proj (down). Anything else is refused with a message that
names the adapter and the problem (LoRAError, a ValueError: the server's 400).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from orca_jax.config import ModelConfig, ModelFamily
from orca_jax.models.safetensors_io import SafetensorsFile  # bf16-aware, checked reads
from orca_jax.models.weights import WeightsError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # what our layers can adapt (model layout)
LLAMA_TARGETS = {f"{p}_proj": p for p in PROJECTIONS}
GPT2_TARGETS = {"c_attn": ("q", "k", "v"), "c_proj": ("o", "down"), "c_fc": ("up",)}
# peft's module names -> (layer, our projections); the model wrapper's prefix is optional.
_LLAMA_MODULE = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj")
_GPT2_MODULE = re.compile(r"(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)")
_GPT2_PARTS = {"attn.c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "mlp.c_fc": ("up",),
               "mlp.c_proj": ("down",)}
_TENSOR = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight")
# Config switches that change what the adapter computes beyond B @ A: refused, not approximated.
_REFUSED = {"use_dora": "DoRA", "lora_bias": "a bias on lora_B", "layer_replication": "layer replication",
            "modules_to_save": "fully trained modules (modules_to_save)",
            "trainable_token_indices": "trained token embeddings", "target_parameters": "target_parameters"}


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter's weights in the model layout, on the host, scaling folded into B."""

    name: str
    rank: int  # the largest rank of its modules (smaller ones are zero-padded on device alike)
    # Per layer, per adapted projection: (a f32[*in, r], b f32[r, *out]); missing: not adapted.
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def projection_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each adaptable projection's (input, output) shape in the model layout."""
    h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_size
    shapes = {"q": ((h,), (n, d)), "k": ((h,), (k, d)), "v": ((h,), (k, d)), "o": ((n, d), (h,)),
              "up": ((h,), (f,)), "down": ((f,), (h,))}
    if config.family is ModelFamily.LLAMA:
        shapes["gate"] = ((h,), (f,))
    return shapes


def _fail(name: str, problem: str) -> LoRAError:
    return LoRAError(f"LoRA adapter {name!r}: {problem}")


def read_adapter_config(path: str, name: str) -> dict:
    """adapter_config.json, with the switches we cannot serve refused."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _fail(name, f"{path}: no such directory")
    if not os.path.isfile(config_path):
        raise _fail(name, f"{config_path}: no such file (not a peft adapter directory)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise _fail(name, f"{config_path}: cannot read JSON ({err})") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{config_path}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(name, f"peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise _fail(name, f"{what} ({key}={config[key]!r}) is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(name, f"bias={config['bias']!r} (trained base biases) is not supported; only 'none'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise _fail(name, f"{config_path}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def _check_targets(config: dict, family: ModelFamily, name: str) -> None:
    targets = config.get("target_modules")
    known = LLAMA_TARGETS if family is ModelFamily.LLAMA else GPT2_TARGETS
    if isinstance(targets, str) or targets is None:  # a regex or "all-linear": the tensors tell
        return
    # peft matches a list entry against the end of a module's name ("mlp.c_fc" or "c_fc").
    unknown = sorted(t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in known)
    if unknown:
        raise _fail(name, f"unknown target module {unknown[0]!r} (this {family.value} model can adapt "
                          f"{', '.join(sorted(known))})")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the module's name end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _module_parts(module: str, family: ModelFamily) -> tuple[int, tuple[str, ...]] | None:
    """(layer, our projections) of a peft module name, or None if we cannot adapt it."""
    if family is ModelFamily.LLAMA:
        match = _LLAMA_MODULE.fullmatch(module)
        if match and f"{match[2]}_proj" in LLAMA_TARGETS:
            return int(match[1]), (match[2],)
        return None
    match = _GPT2_MODULE.fullmatch(module)
    return (int(match[1]), _GPT2_PARTS[match[2]]) if match else None


def load_adapter(path: str, name: str, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a peft directory against `model` (its own shapes, not tensor-parallel ones)."""
    config = read_adapter_config(path, name)
    _check_targets(config, model.family, name)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        other = " (only safetensors is read; adapter_model.bin is not)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise _fail(name, f"{weights_path}: no such file{other}")
    try:
        file = SafetensorsFile(weights_path)
        pairs: dict[str, dict[str, np.ndarray]] = {}
        for tensor in file.entries:
            match = _TENSOR.fullmatch(tensor)
            if match is None:
                raise _fail(name, f"unknown tensor {tensor!r} (only lora_A / lora_B weights are served)")
            pairs.setdefault(match[1], {})[match[2]] = file.read(tensor)
    except WeightsError as err:
        raise _fail(name, str(err)) from None
    if not pairs:
        raise _fail(name, f"{weights_path} holds no LoRA weights")
    shapes = projection_shapes(model)
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(model.num_layers)]
    max_found = 0
    for module, pair in sorted(pairs.items()):
        parsed = _module_parts(module, model.family)
        if parsed is None:
            raise _fail(name, f"unknown target module {module!r}: a {model.family.value} model can adapt "
                              f"{', '.join(sorted(LLAMA_TARGETS if model.family is ModelFamily.LLAMA else GPT2_TARGETS))}")
        layer, parts = parsed
        if layer >= model.num_layers:
            raise _fail(name, f"{module}: the base model has {model.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise _fail(name, f"{module}: lora_{'B' if 'A' in pair else 'A'} is missing")
        rank = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"]))
        if rank > max_rank:
            raise _fail(name, f"rank {rank} is above the server's maximum ({max_rank}; see --max-lora-rank)")
        a, b = pair["A"], pair["B"]
        ins = shapes[parts[0]][0]
        outs = [shapes[p][1] for p in parts]
        width = sum(math.prod(o) for o in outs)
        if a.shape != (rank, math.prod(ins)) or b.shape != (width, rank):
            raise _fail(name, f"{module}: lora_A {a.shape} and lora_B {b.shape} do not fit the base model "
                              f"(expected ({rank}, {math.prod(ins)}) and ({width}, {rank}))")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        a = np.ascontiguousarray(a.astype(np.float32).T.reshape(*ins, rank))
        b_all = b.astype(np.float32).T * np.float32(scaling)  # [r, width]
        offset = 0
        for part, out in zip(parts, outs):
            size = math.prod(out)
            layers[layer][part] = (a, np.ascontiguousarray(b_all[:, offset:offset + size].reshape(rank, *out)))
            offset += size
        max_found = max(max_found, rank)
    return LoRAAdapter(name, max_found, tuple(layers))


def random_adapter(model: ModelConfig, rank: int, seed: int, name: str = "random",
                   projections: tuple[str, ...] | None = None, b_std: float = 0.01) -> LoRAAdapter:
    """An adapter of random weights on `projections` (default: every one the model has), for
    benchmarks on models without files: A ~ N(0, 1/in) as peft's Kaiming init, B ~ N(0, b_std) (not
    zero, so the adapter changes the output)."""
    rng = np.random.default_rng(seed)
    shapes = projection_shapes(model)
    projections = tuple(shapes) if projections is None else projections

    def draw(shape, std):
        return (rng.standard_normal(shape, np.float32) * np.float32(std))

    layers = tuple({p: (draw((*shapes[p][0], rank), 1 / math.sqrt(math.prod(shapes[p][0]))),
                        draw((rank, *shapes[p][1]), b_std)) for p in projections}
                   for _ in range(model.num_layers))
    return LoRAAdapter(name, rank, layers)
