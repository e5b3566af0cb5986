"""One Flax decoder for GPT-2/GPT-3 and Llama-style models, built for ragged token-flattened batches.

Every op but attention sees one flat [T, H] tensor holding all requests' new tokens (ORCA's selective
batching). Per-layer weights are stacked on a leading axis and applied with a scan, so compile time
does not grow with depth. Einsum letters: T tokens, H hidden, N query heads, K kv heads, D head dim,
F ffn, V vocab, S sequences.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig, ModelFamily, RopeScaling
from orca_jax.models.attention import AttentionMetadata, KVCache, RaggedAttentionFn, paged_attention

_init_weight = nn.initializers.normal(stddev=0.02)


def _dtype(config: ModelConfig):
    return jnp.dtype(config.dtype)


class Norm(nn.Module):
    """LayerNorm (GPT) or RMSNorm (Llama), computed in fp32."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [T, H] -> [T, H]
        cfg = self.config
        scale = self.param("scale", nn.initializers.ones, (cfg.hidden_size,), _dtype(cfg))
        xf = x.astype(jnp.float32)
        if cfg.family is ModelFamily.GPT:
            bias = self.param("bias", nn.initializers.zeros, (cfg.hidden_size,), _dtype(cfg))
            xf = xf - xf.mean(-1, keepdims=True)
            y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + cfg.norm_eps)
            y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        else:
            y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + cfg.norm_eps)
            y = y * scale.astype(jnp.float32)
        return y.astype(x.dtype)


class Linear(nn.Module):
    """An einsum with a kernel of shape `shape` and, for GPT (or when `bias` says so), a bias."""

    config: ModelConfig
    equation: str
    shape: tuple[int, ...]
    bias_shape: tuple[int, ...]
    bias: bool | None = None  # None: the family decides (GPT has biases, Llama none)

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kernel = self.param("kernel", _init_weight, self.shape, _dtype(cfg))
        y = jnp.einsum(self.equation, x, kernel)
        has_bias = cfg.family is ModelFamily.GPT if self.bias is None else self.bias
        if has_bias:
            y = y + self.param("bias", nn.initializers.zeros, self.bias_shape, _dtype(cfg))
        return y


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """f32[D/2]: RoPE's inverse frequencies, with Llama 3.1's scaling applied when given.

    Computed on the host in float32 as transformers computes them, so positions far out agree too.
    """
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                               / np.float32(head_dim)))).astype(np.float32)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position
    low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept; the band between blends the two.
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, rotate-half convention (x: [T, heads, D], positions: i32[T])."""
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling))  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    attention_fn: RaggedAttentionFn

    @nn.compact
    def __call__(self, x, positions, cache: KVCache, layer, meta: AttentionMetadata):
        cfg = self.config
        h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = cfg.family is ModelFamily.GPT or cfg.qkv_bias  # Qwen2: q/k/v biases, no o bias
        q = Linear(cfg, "TH,HND->TND", (h, n, d), (n, d), qkv_bias, name="q")(x)  # [T, N, D]
        key = Linear(cfg, "TH,HKD->TKD", (h, k, d), (k, d), qkv_bias, name="k")(x)  # [T, K, D]
        value = Linear(cfg, "TH,HKD->TKD", (h, k, d), (k, d), qkv_bias, name="v")(x)  # [T, K, D]
        if cfg.family is ModelFamily.LLAMA:
            q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
            key = apply_rope(key, positions, cfg.rope_theta, cfg.rope_scaling)
        out, cache = paged_attention(q, key, value, cache, layer, meta, self.attention_fn)
        return Linear(cfg, "TND,NDH->TH", (n, d, h), (h,), name="o")(out), cache


class Mlp(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):  # [T, H] -> [T, H]
        cfg = self.config
        h, f = cfg.hidden_size, cfg.ffn_size
        up = Linear(cfg, "TH,HF->TF", (h, f), (f,), name="up")(x)
        if cfg.family is ModelFamily.GPT:
            act = jax.nn.gelu(up, approximate=True)
        else:
            gate = Linear(cfg, "TH,HF->TF", (h, f), (f,), name="gate")(x)
            act = jax.nn.silu(gate) * up
        return Linear(cfg, "TF,FH->TH", (f, h), (h,), name="down")(act)


class Block(nn.Module):
    """One pre-norm transformer layer; scanned over the stacked layer axis."""

    config: ModelConfig
    attention_fn: RaggedAttentionFn

    @nn.compact
    def __call__(self, carry, layer, positions, meta):
        x, cache = carry
        attn_out, cache = Attention(self.config, self.attention_fn, name="attn")(
            Norm(self.config, name="attn_norm")(x), positions, cache, layer, meta)
        x = x + attn_out
        x = x + Mlp(self.config, name="mlp")(Norm(self.config, name="mlp_norm")(x))
        return (x, cache), None


class Decoder(nn.Module):
    """Ragged forward pass: new tokens of all requests in, logits at the requested rows out."""

    config: ModelConfig
    attention_fn: RaggedAttentionFn
    # Layers unrolled per loop step; the param layout stays stacked either way (see
    # EngineConfig.unroll_layers for what each choice costs on GPU).
    scan_unroll: int = 1

    @nn.compact
    def __call__(
        self,
        token_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: jax.Array,  # i32[S]: the row of each request's last new token
    ) -> tuple[jax.Array, KVCache]:  # (f32[S, V], cache)
        cfg = self.config
        embed = self.param("embed", _init_weight, (cfg.vocab_size, cfg.hidden_size), _dtype(cfg))  # [V, H]
        x = embed[token_ids]  # [T, H]
        if cfg.family is ModelFamily.GPT:
            pos_embed = self.param("pos_embed", nn.initializers.normal(0.01),
                                   (cfg.max_seq_len, cfg.hidden_size), _dtype(cfg))
            x = x + pos_embed[positions]
        layers = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            unroll=self.scan_unroll,
        )(cfg, self.attention_fn, name="layers")
        (x, cache), _ = layers((x, cache), jnp.arange(cfg.num_layers, dtype=jnp.int32), positions, meta)
        x = Norm(cfg, name="final_norm")(x[logits_indices])  # [S, H]
        if cfg.tie_embeddings:
            logits = jnp.einsum("SH,VH->SV", x, embed, preferred_element_type=jnp.float32)
        else:
            head = self.param("lm_head", _init_weight, (cfg.hidden_size, cfg.vocab_size), _dtype(cfg))
            logits = jnp.einsum("SH,HV->SV", x, head, preferred_element_type=jnp.float32)
        return logits, cache


def empty_cache(config: ModelConfig, num_pages: int, page_size: int) -> KVCache:
    """Zeroed K/V pages for every layer: [L, KVH, num_pages, page_size, D] each."""
    shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
    return KVCache(jnp.zeros(shape, _dtype(config)), jnp.zeros(shape, _dtype(config)))


def _dummy_inputs(config: ModelConfig):
    cache = empty_cache(config, num_pages=2, page_size=1)
    meta = AttentionMetadata(
        cu_q_lens=jnp.array([0, 1], jnp.int32), kv_lens=jnp.array([1], jnp.int32),
        page_table=jnp.array([[1]], jnp.int32), slot_mapping=jnp.array([1], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32))
    return jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), cache, meta, jnp.zeros((1,), jnp.int32)


def param_shapes(config: ModelConfig, attention_fn: RaggedAttentionFn):
    """The params pytree as ShapeDtypeStructs, computed without allocating anything."""
    model = Decoder(config, attention_fn)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy_inputs(config))["params"])


def init_params(config: ModelConfig, attention_fn: RaggedAttentionFn, seed: int = 0, out_shardings=None):
    """Random weights made on device inside jit, in the config's dtype (the paper's evaluation setup)."""
    model = Decoder(config, attention_fn)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def _init(key):
        return model.init(key, *_dummy_inputs(config))["params"]

    return _init(jax.random.key(seed))
