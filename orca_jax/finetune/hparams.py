"""A fine-tuning job's settings: the adapter it trains and how (frozen, checked; no jax).

OpenAI's hyperparameters (n_epochs, batch_size, learning_rate_multiplier) plus the LoRA ones
(rank, alpha, target modules) and the optimizer's, with the defaults a LoRA run commonly uses.
"""

from __future__ import annotations

import dataclasses
import math

from orca_jax.config import ModelFamily
from orca_jax.lora.adapter import MAX_ALPHA, MAX_RANK

# peft's module names within a layer -> the projections of ours (model layout) each adapts. GPT-2's
# c_attn computes q, k and v with one A (peft adapts the fused module); Llama-family models adapt each.
LLAMA_MODULES = {"self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",), "self_attn.v_proj": ("v",),
                 "self_attn.o_proj": ("o",), "mlp.gate_proj": ("gate",), "mlp.up_proj": ("up",),
                 "mlp.down_proj": ("down",)}
GPT2_MODULES = {"attn.c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "mlp.c_fc": ("up",),
                "mlp.c_proj": ("down",)}


def family_modules(family: ModelFamily) -> dict[str, tuple[str, ...]]:
    return LLAMA_MODULES if family is ModelFamily.LLAMA else GPT2_MODULES


def resolve_targets(targets: tuple[str, ...] | None, family: ModelFamily) -> tuple[str, ...]:
    """Target names as peft takes them ("q_proj", "mlp.c_proj", or "all-linear"; None: all) -> the
    family's module keys they match, in layer order. ValueError naming an unknown one."""
    modules = family_modules(family)
    if targets is None or targets == ("all-linear",):
        return tuple(modules)
    chosen = set()
    for target in targets:
        # peft matches a name against the end of a module's name, at a dot boundary.
        hits = {key for key in modules if key == target or key.endswith("." + target)}
        if not hits:
            short = sorted({key.rsplit(".", 1)[-1] for key in modules})
            raise ValueError(f"unknown LoRA target module {target!r}: a {family.value} model has "
                             f"{', '.join(short)} (or 'all-linear')")
        chosen |= hits
    return tuple(key for key in modules if key in chosen)


# Bounds every job is held to whatever the server allows: finite numbers in ranges no LoRA recipe
# leaves (a NaN learning rate trained an adapter of NaN that emptied every request once served).
DEFAULT_MICRO_BATCH_TOKENS = 2048  # a job's micro-batch when it names none and this fits its memory
MAX_LEARNING_RATE_MULTIPLIER = 100.0  # of base_learning_rate (2e-4): a peak rate of 0.02
MAX_SEED = 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(name: str, value, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> None:
    """ValueError naming the field and its range unless `value` is a finite number within it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")


def _positive_int(name: str, value, high: int | None = None) -> None:
    if not _is_int(value) or value < 1 or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer from 1{'' if high is None else f' to {high}'}, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class LoRASpec:
    """The adapter a job trains: peft's r, lora_alpha and target_modules (resolved to module keys)."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = tuple(LLAMA_MODULES)
    use_rslora: bool = False

    def __post_init__(self):
        _positive_int("LoRA rank", self.rank, MAX_RANK)
        _in_range("LoRA alpha", self.alpha, 0, MAX_ALPHA, low_open=True)
        if not self.target_modules:
            raise ValueError("LoRA target_modules must name at least one module")

    @property
    def scaling(self) -> float:
        """peft's factor on B @ A: alpha / r (alpha / sqrt(r) with rslora)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingHyperparameters:
    """How a job trains. A step is `batch_size` examples; its gradient is the mean over their completion
    tokens, accumulated over micro-batches of at most `micro_batch_tokens` tokens (one fine-tuning
    iteration each, the unit the engine interleaves with inference)."""

    n_epochs: int = 3
    batch_size: int = 8  # examples per optimizer step
    learning_rate_multiplier: float = 1.0
    base_learning_rate: float = 2e-4  # times the multiplier: AdamW's peak learning rate
    warmup_ratio: float = 0.03  # of the steps, linear warm-up from 0; then cosine decay to 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # clipped by global norm; 0: no clipping
    # rows x row length of one fine-tuning iteration; None: the most, up to DEFAULT_MICRO_BATCH_TOKENS,
    # that fit the memory fine-tuning may use (compiled sizes measured: sizing.py)
    micro_batch_tokens: int | None = None
    seed: int = 0  # data order and the adapter's initial A
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of each epoch only

    def __post_init__(self):
        # How large a job may be (epochs, batch, micro-batch) is the server's to say (FineTuningConfig);
        # here every value is finite and in the range its meaning allows.
        for name in ("n_epochs", "batch_size"):
            _positive_int(name, getattr(self, name))
        if self.micro_batch_tokens is not None:
            _positive_int("micro_batch_tokens", self.micro_batch_tokens)
        _in_range("learning_rate_multiplier", self.learning_rate_multiplier, 0, MAX_LEARNING_RATE_MULTIPLIER,
                  low_open=True)
        _in_range("base_learning_rate", self.base_learning_rate, 0, 1, low_open=True)
        _in_range("warmup_ratio", self.warmup_ratio, 0, 1, high_open=True)
        _in_range("weight_decay", self.weight_decay, 0, 1)
        _in_range("adam_beta1", self.adam_beta1, 0, 1, high_open=True)
        _in_range("adam_beta2", self.adam_beta2, 0, 1, high_open=True)
        _in_range("adam_eps", self.adam_eps, 0, 1, low_open=True)
        _in_range("max_grad_norm", self.max_grad_norm, 0, 1e6)
        if not _is_int(self.checkpoint_every) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an integer from 0, got {self.checkpoint_every!r}")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}")

    @property
    def learning_rate(self) -> float:
        return self.base_learning_rate * self.learning_rate_multiplier
