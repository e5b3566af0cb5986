"""A fine-tuning job's settings: the adapter it trains and how (frozen, checked; no jax).

OpenAI's hyperparameters (n_epochs, batch_size, learning_rate_multiplier) plus the LoRA ones
(rank, alpha, target modules) and the optimizer's, with the defaults a LoRA run commonly uses.
"""

from __future__ import annotations

import dataclasses
import math

from orca_jax.config import ModelFamily

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


@dataclasses.dataclass(frozen=True, slots=True)
class LoRASpec:
    """The adapter a job trains: peft's r, lora_alpha and target_modules (resolved to module keys)."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = tuple(LLAMA_MODULES)
    use_rslora: bool = False

    def __post_init__(self):
        if self.rank <= 0 or self.alpha <= 0:
            raise ValueError(f"LoRA rank and alpha must be positive, got {self.rank}, {self.alpha}")
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
    micro_batch_tokens: int = 2048  # rows x row length of one fine-tuning iteration
    seed: int = 0  # data order and the adapter's initial A
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of each epoch only

    def __post_init__(self):
        for name in ("n_epochs", "batch_size", "micro_batch_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.learning_rate_multiplier <= 0 or self.base_learning_rate <= 0:
            raise ValueError("learning_rate_multiplier and base_learning_rate must be positive")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.weight_decay < 0 or self.max_grad_norm < 0 or self.checkpoint_every < 0:
            raise ValueError("weight_decay, max_grad_norm and checkpoint_every must not be negative")

    @property
    def learning_rate(self) -> float:
        return self.base_learning_rate * self.learning_rate_multiplier
