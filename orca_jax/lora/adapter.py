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
import math
import os
import re

import numpy as np

from orca_jax import json_limits
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
# Bounds on what an adapter directory may hold. A rank is also bounded by the server's --max-lora-rank;
# alpha is commonly r or 2r, so 2**16 is far above any published setting (and keeps alpha / r x B finite).
MAX_RANK = 2**16
MAX_ALPHA = 2.0**16
# The largest finite value of each serving dtype; and how far an adapter may multiply its inputs.
DTYPE_MAX = {"float32": 3.4028235e38, "bfloat16": 3.3895314e38, "float16": 65504.0}
# A module's gain (for inputs of magnitude up to 1, the most it can add to one output: the largest row
# sum of |B| (alpha / r folded in) times that of |A|) stays within what the dtype holds, and never past
# sqrt(f32 max) ~ 1.8e19, beyond which the next norm's squares (taken in f32) overflow; divided by
# 2^8 for the inputs' own size and the residual's growth over layers. Trained adapters' gains are ~10-100.
GAIN_HEADROOM = 2.0**8
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json (peft's are ~1 KB)
MAX_HEADER_BYTES = 16 << 20  # the safetensors header (a 70B model's every module: ~200 KB)
MAX_TARGETS = 1024  # entries of target_modules
# rank_pattern and alpha_pattern keys, each a regular expression matched against every module name
# (Python's backtracking engine): 256 keys of at most 2 repetitions over a 70B model's 560 modules
# take well under a second.
MAX_PATTERNS = 256
MAX_PATTERN_KEY_CHARS = 256
MAX_PATTERN_REPEATS = 2
_REPEAT = re.compile(r"[*+?{]")
_REPEATED_GROUP = re.compile(r"\)[*+?{]")
# Config switches that change what the adapter computes beyond B @ A: refused, not approximated.
_REFUSED = {"use_dora": "DoRA", "lora_bias": "a bias on lora_B", "layer_replication": "layer replication",
            "modules_to_save": "fully trained modules",
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


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rank(value, what: str) -> str | None:
    """Why `value` is not a rank (peft's r: a positive integer), or None."""
    if not _is_number(value) or not math.isfinite(value) or value != int(value) or not 1 <= value <= MAX_RANK:
        return f"{what} must be an integer between 1 and {MAX_RANK}"
    return None


def _check_alpha(value, what: str) -> str | None:
    if not _is_number(value) or not 0 < value <= MAX_ALPHA:  # NaN fails both comparisons
        return f"{what} must be a finite number above 0 and at most {MAX_ALPHA}"
    return None


def _check_pattern_key(key) -> str | None:
    """Why a rank_pattern / alpha_pattern key cannot be matched safely, or None. peft matches each as
    a regular expression against module names (Python's backtracking engine): one with a repeated
    group or more than MAX_PATTERN_REPEATS repetitions could take exponential or high polynomial time."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_PATTERN_KEY_CHARS:
        return f"must be strings of 1 to {MAX_PATTERN_KEY_CHARS} characters"
    try:
        re.compile(key)
    except (re.error, RecursionError, OverflowError):
        return "must be valid regular expressions"
    if _REPEATED_GROUP.search(key) or len(_REPEAT.findall(key.replace("(?", "("))) > MAX_PATTERN_REPEATS:
        return (f"may repeat at most {MAX_PATTERN_REPEATS} characters or classes (*, +, ?, {{}}) and no "
                "group, so matching them stays fast")
    return None


def _check_patterns(config: dict, config_path: str) -> str | None:
    for key, check in (("rank_pattern", _check_rank), ("alpha_pattern", _check_alpha)):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict) or len(patterns) > MAX_PATTERNS:
            return f"{config_path}: {key} must be an object of at most {MAX_PATTERNS} module patterns"
        for pattern, value in patterns.items():
            problem = _check_pattern_key(pattern)
            if problem is not None:
                return f"{config_path}: {key}'s keys {problem}"
            problem = check(value, f"{key}'s values")
            if problem is not None:
                return f"{config_path}: {problem}"
    return None


def _check_config_values(config: dict, config_path: str) -> str | None:
    """The first value of adapter_config.json that cannot be served, as a rule that names the file and
    the key (never the value: the path may point at any readable file), or None."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"{config_path}: peft_type must be \"LORA\" (only LoRA adapters are served)"
    for key, what in _REFUSED.items():
        if config.get(key):
            return f"{config_path}: {what} ({key}) is not supported"
    if config.get("bias", "none") != "none":
        return f"{config_path}: bias must be \"none\" (trained base biases are not supported)"
    problem = _check_rank(config.get("r"), "r") or _check_alpha(config.get("lora_alpha"), "lora_alpha")
    if problem is not None:
        return f"{config_path}: {problem}"
    if not isinstance(config.get("use_rslora", False), bool):
        return f"{config_path}: use_rslora must be true or false"
    targets = config.get("target_modules")
    if not (targets is None or isinstance(targets, str) or
            (isinstance(targets, list) and len(targets) <= MAX_TARGETS and all(isinstance(t, str) for t in targets))):
        return (f"{config_path}: target_modules must be a string or a list of at most {MAX_TARGETS} module "
                "names")
    return _check_patterns(config, config_path)


def read_adapter_config(path: str, name: str) -> dict:
    """adapter_config.json, checked: values in range and finite, the switches we cannot serve refused."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _fail(name, f"{path}: no such directory")
    if not os.path.isfile(config_path):
        raise _fail(name, f"{config_path}: no such file (not a peft adapter directory)")
    try:
        with open(config_path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise _fail(name, f"{config_path}: cannot be read ({err.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _fail(name, f"{config_path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json_limits.loads(data, config_path)
    except json_limits.JSONLimitError as err:
        raise _fail(name, str(err)) from None
    if not isinstance(config, dict):
        raise _fail(name, f"{config_path}: not a JSON object")
    problem = _check_config_values(config, config_path)
    if problem is not None:
        raise _fail(name, problem)
    return config


def _check_targets(config: dict, family: ModelFamily, name: str) -> None:
    targets = config.get("target_modules")
    known = LLAMA_TARGETS if family is ModelFamily.LLAMA else GPT2_TARGETS
    if isinstance(targets, str) or targets is None:  # a regex or "all-linear": the tensors tell
        return
    # peft matches a list entry against the end of a module's name ("mlp.c_fc" or "c_fc"). The
    # entries are not echoed: they come from the file.
    if any(t.rsplit(".", 1)[-1] not in known for t in targets):
        raise _fail(name, f"target_modules names a module this {family.value} model cannot adapt (it can adapt "
                          f"{', '.join(sorted(known))})")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the module's name end
    (keys checked by _check_pattern_key; module names by _module_parts)."""
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


@dataclasses.dataclass(frozen=True)
class _Module:
    """One adapted module as the header describes it, checked before any weight is read."""

    layer: int
    parts: tuple[str, ...]  # our projections
    rank: int
    scaling: float
    ins: tuple[int, ...]  # the model layout's input shape
    outs: tuple[tuple[int, ...], ...]  # each part's output shape
    tensor_a: str  # the file's names of lora_A and lora_B
    tensor_b: str


def _plan_modules(file: SafetensorsFile, config: dict, model: ModelConfig, max_rank: int,
                  name: str) -> dict[str, _Module]:
    """Every module of the file, its tensors' names and shapes checked against the base model."""
    weights_path = file.path
    pairs: dict[str, dict[str, str]] = {}  # module -> "A" / "B" -> tensor name
    for tensor in file.entries:
        match = _TENSOR.fullmatch(tensor)
        # Names we cannot adapt are not echoed: the path may point at any safetensors file.
        if match is None or _module_parts(match[1], model.family) is None:
            known = LLAMA_TARGETS if model.family is ModelFamily.LLAMA else GPT2_TARGETS
            raise _fail(name, f"{weights_path}: holds a tensor that is not the lora_A or lora_B weight of a module "
                              f"a {model.family.value} model can adapt ({', '.join(sorted(known))})")
        if match[2] in pairs.setdefault(match[1], {}):
            raise _fail(name, f"{weights_path}: {match[1]} has two lora_{match[2]} weights")
        pairs[match[1]][match[2]] = tensor
    if not pairs:
        raise _fail(name, f"{weights_path} holds no LoRA weights")
    shapes = projection_shapes(model)
    modules = {}
    for module, halves in sorted(pairs.items()):
        layer, parts = _module_parts(module, model.family)
        if layer >= model.num_layers:
            raise _fail(name, f"{module}: the base model has {model.num_layers} layers")
        if set(halves) != {"A", "B"}:
            raise _fail(name, f"{module}: lora_{'B' if 'A' in halves else 'A'} is missing")
        rank = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"]))
        if rank > max_rank:
            raise _fail(name, f"rank {rank} is above the server's maximum ({max_rank}; see --max-lora-rank)")
        ins = shapes[parts[0]][0]
        outs = tuple(shapes[p][1] for p in parts)
        width = sum(math.prod(o) for o in outs)
        for half, expected in (("A", (rank, math.prod(ins))), ("B", (width, rank))):
            if file.entries[halves[half]][1] != expected:
                raise _fail(name, f"{module}: lora_{half} does not fit the base model (expected shape {expected} "
                                  f"for rank {rank})")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[module] = _Module(layer, parts, rank, scaling, ins, outs, halves["A"], halves["B"])
    return modules


def load_adapter(path: str, name: str, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a peft directory against `model` (its own shapes, not tensor-parallel ones): the
    config's values, the tensors' names and shapes before any weight is read, the weights finite."""
    config = read_adapter_config(path, name)
    _check_targets(config, model.family, name)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        other = " (only safetensors is read; adapter_model.bin is not)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise _fail(name, f"{weights_path}: no such file{other}")
    try:
        file = SafetensorsFile(weights_path, max_header_bytes=MAX_HEADER_BYTES)
        modules = _plan_modules(file, config, model, max_rank, name)
        layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(model.num_layers)]
        for module, plan in modules.items():
            _add_module(layers, module, plan, file.read(plan.tensor_a), file.read(plan.tensor_b), name, model.dtype)
    except WeightsError as err:
        raise _fail(name, str(err)) from None
    return LoRAAdapter(name, max(plan.rank for plan in modules.values()), tuple(layers))


def _add_module(layers: list[dict], module: str, plan: _Module, lora_a: np.ndarray, lora_b: np.ndarray,
                name: str, dtype: str) -> None:
    """One module's weights (torch layout, lora_A [r, in], lora_B [out, r]) into `layers` in the model
    layout, scaled; LoRAError unless finite and small enough to serve in `dtype` (_check_size)."""
    a = np.ascontiguousarray(lora_a.astype(np.float32).T.reshape(*plan.ins, plan.rank))
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
        b_all = lora_b.astype(np.float32).T * np.float32(plan.scaling)  # [r, width]
    if not (np.isfinite(a).all() and np.isfinite(b_all).all()):
        raise _fail(name, f"{module}: its weights (lora_B times alpha / r) must be finite; they hold NaN or "
                          "infinite values")
    _check_size(lora_a, b_all, plan, dtype, name)
    offset = 0
    for part, out in zip(plan.parts, plan.outs):
        size = math.prod(out)
        layers[plan.layer][part] = (a, np.ascontiguousarray(b_all[:, offset:offset + size].reshape(plan.rank, *out)))
        offset += size


def _check_size(lora_a: np.ndarray, b_all: np.ndarray, plan: _Module, dtype: str, name: str) -> None:
    """LoRAError naming the tensor when a weight is beyond `dtype`'s range, or the module's gain
    (GAIN_HEADROOM's comment) would overflow the activations: finite weights like 1e19 that still
    turn every request's logits into NaN."""
    largest = DTYPE_MAX[dtype]
    for tensor, weights in ((plan.tensor_a, lora_a), (plan.tensor_b, b_all)):
        peak = float(np.abs(weights).max(initial=0.0))
        if peak > largest:
            raise _fail(name, f"{tensor}: holds {peak:.3g} (lora_B times alpha / r), beyond the largest {dtype} "
                              f"value ({largest:.3g}) the server computes in")
    # float64 sums: the f32 ones of weights near the range's end would overflow themselves.
    gain = (float(np.abs(lora_a).sum(axis=1, dtype=np.float64).max(initial=0.0))
            * float(np.abs(b_all).sum(axis=0, dtype=np.float64).max(initial=0.0)))
    limit = min(largest, math.sqrt(DTYPE_MAX["float32"])) / GAIN_HEADROOM
    if gain > limit:
        raise _fail(name, f"{plan.tensor_a} and {plan.tensor_b}: together they can multiply an input {gain:.3g}-fold "
                          f"(lora_B times alpha / r times lora_A), more than {limit:.3g}, past which {dtype} "
                          "activations overflow; the weights are too large to serve")


def check_finite(adapter: LoRAAdapter) -> None:
    """LoRAError unless every weight of an adapter made in memory is finite (files: load_adapter)."""
    for i, layer in enumerate(adapter.layers):
        for part, (a, b) in layer.items():
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                raise _fail(adapter.name, f"layer {i} {part}: its weights must be finite; they hold NaN or "
                                          "infinite values")


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
