"""FP8 projections (Quantization.FP8): e4m3 weights with one f32 scale per output channel.

Stored form, per projection of the compute layout (projections.py): {"weight": e4m3 [out..., in...],
"weight_scale": f32 [out...]} (plus the bias, unchanged) instead of {"kernel": [in..., out...]}. Output
channels first and the input features last is the layout both of an FP8 GEMM's operands take on
Hopper (K-major); with [K, N] weights XLA's FP8 dot measured 0.15 TB/s at 16 rows against 2.1 with
[N, K] (benchmarks/results/h200/notes.md, FP8 forms). Tensor parallelism splits the same named
dimension as before (sharding/rules.py), and each scale travels with its channels.

An untied LM head [H, V] is stored the same way, {"weight": e4m3 [V, H], "weight_scale": f32 [V]} (one
scale per vocabulary row), unless ModelConfig.quantize_lm_head is off: on llama-8b it is 1.05 GB of bf16,
~0.24 ms of a 2.97 ms FP8 batch-1 step on an H200. Its logits stay f32 (linear's out_dtype).

How a batch multiplies them depends on its rows (MatmulForm), measured inside a 32-layer program on
an H200 (llama-8b's MLP shapes, us per layer at 1 / 16 / 128 / 2048 rows; bf16 32.9 / 34.8 / 42.1 /
358): converting the e4m3 weights to bf16 inside XLA's GEMM (W8A16) 25.3 / 25.7 / 45.0 / 409;
quantizing the activations per row to e4m3 and XLA's FP8 x FP8 dot (W8A8, cuBLASLt) 25.8 / 28.3 / 32.9 /
233. So decode-sized batches read the weights as W8A16 (no activation rounding), larger ones run W8A8 at
Hopper's FP8 rate. Per-row activation scales keep a token's result independent of the other rows.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from orca_jax.config import Quantization

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value

# Where each projection's kernel sits in the compute-layout tree, and how many of its leading axes are
# input features (the rest are output channels).
PROJECTIONS: dict[tuple[str, str], int] = {
    ("attn", "qkv"): 1,  # [H, K, G + 2, D]
    ("attn", "o"): 2,  # [N, D, H]
    ("mlp", "gate_up"): 1,  # [H, 2, F]
    ("mlp", "up"): 1,  # [H, F] (GPT)
    ("mlp", "down"): 1,  # [F, H]
}

# Batches of at most this many rows read the weights as W8A16; larger ones run W8A8.
W8A16_MAX_ROWS = 64


class MatmulForm(enum.Enum):
    """How a batch multiplies by FP8 weights."""

    W8A16 = "w8a16"  # weights converted to the activations' dtype inside the GEMM
    W8A8 = "w8a8"  # activations quantized per row too; an FP8 x FP8 dot


def form_for(rows: int) -> MatmulForm:
    return MatmulForm.W8A16 if rows <= W8A16_MAX_ROWS else MatmulForm.W8A8


def quantize(kernel: jax.Array, num_in: int) -> dict:
    """A compute-layout kernel [in..., out...] -> {"weight": e4m3 [out..., in...], "weight_scale":
    f32 [out...]}: each output channel scaled so its largest magnitude is e4m3's largest value (an
    all-zero channel gets scale 1)."""
    axes = tuple(range(kernel.ndim))
    weight = jnp.transpose(kernel.astype(jnp.float32), axes[num_in:] + axes[:num_in])  # [out..., in...]
    in_axes = tuple(range(kernel.ndim - num_in, kernel.ndim))
    amax = jnp.max(jnp.abs(weight), axis=in_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    stored = jnp.clip(weight / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return {"weight": stored, "weight_scale": scale.reshape(scale.shape[:kernel.ndim - num_in])}


def dequantize(weight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The inverse layout of quantize: [out..., in...] e4m3 and its scales -> [in..., out...] in dtype."""
    num_out = scale.ndim
    full = weight.astype(jnp.float32) * scale.reshape(scale.shape + (1,) * (weight.ndim - num_out))
    axes = tuple(range(weight.ndim))
    return jnp.transpose(full, axes[num_out:] + axes[:num_out]).astype(dtype)


def quantize_layer(layer: dict, quantization: Quantization | None) -> dict:
    """One compute-layout layer with its projections in the stored FP8 form (unchanged for None)."""
    if quantization is None:
        return layer
    out = dict(layer)
    for (block, name), num_in in PROJECTIONS.items():
        if name in layer.get(block, {}):
            proj = dict(layer[block][name])
            proj.update(quantize(proj.pop("kernel"), num_in))
            out[block] = dict(out[block], **{name: proj})
    return out


def quantize_projections(params: dict, quantization: Quantization | None) -> dict:
    """A compute-layout params tree (or part of one) with every layer's projections stored as FP8."""
    if quantization is None or "layers" not in params:
        return params
    return dict(params, layers=[quantize_layer(layer, quantization) for layer in params["layers"]])


def quantize_lm_head(params: dict) -> dict:
    """A params tree (or part of one) with its LM head [H, V] stored as {"weight": e4m3 [V, H],
    "weight_scale": f32 [V]}: one scale per vocabulary row, like any projection's output channels.
    Callers check ModelConfig.lm_head_quantized: a tied table stays in dtype, since it is also the
    embedding lookup (rows gathered by token id), and reading it as FP8 there would round every input.
    Quantized after tensor_plan pads the vocabulary, so padded rows are zero with scale 1."""
    if "lm_head" not in params or isinstance(params["lm_head"], dict):
        return params
    return dict(params, lm_head=quantize(params["lm_head"], num_in=1))


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], f32 [T, 1]): one scale per row, from the row's largest magnitude."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / E4M3_MAX
    return jnp.clip(xf / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def linear(x: jax.Array, weight: jax.Array, scale: jax.Array, form: MatmulForm | None = None,
           out_dtype=None) -> jax.Array:
    """x [T, in...] times an FP8 projection (weight e4m3 [out..., in...], scale f32 [out...]) ->
    [T, out...] in `out_dtype` (None: x's; the LM head asks for f32 logits). `form` None: form_for(T).

    Only the input axes are merged (into K); the output axes stay as they are. Under tensor parallelism
    gate_up's output axes are [2, F] with F split across the devices, and a merged [2F] is no split of
    its own: XLA then gathered and transposed that weight on every step (llama-8b FP8 at (2, 1) on two
    H200s: 18 ms a decode step against 2.8 ms on one; benchmarks/results/h200x2/notes.md)."""
    t = x.shape[0]
    num_out = scale.ndim
    x2 = x.reshape(t, -1)  # [T, K]
    w = weight.reshape(*weight.shape[:num_out], x2.shape[1])  # [out..., K]
    contract = (((1,), (num_out,)), ((), ()))
    if (form or form_for(t)) is MatmulForm.W8A16:
        y = jax.lax.dot_general(x2, w.astype(x.dtype), contract, preferred_element_type=jnp.float32) * scale
    else:
        xq, xs = quantize_rows(x2)  # xs [T, 1]
        y = jax.lax.dot_general(xq, w, contract, preferred_element_type=jnp.float32) \
            * xs.reshape(t, *([1] * num_out)) * scale
    return y.astype(out_dtype or x.dtype)  # [T, out...]
