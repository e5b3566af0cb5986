"""One decoder for GPT-2/GPT-3 and Llama-style models, built for ragged token-flattened batches.

Every op but attention sees one flat [T, H] tensor holding all requests' new tokens (ORCA's selective
batching). A layer is a Flax `Block` with its own params and its own KV pages; the forward pass is a
plain Python loop over layers, so under jit it is unrolled: each layer reads its weights where they
lie (a scan over stacked weights copies every layer's slice first, ~1/3 of HBM bandwidth on an H200)
and updates its donated K/V pages in place. A contiguous range of layers is also a pipeline stage.

Params, on device: {"embed", "pos_embed" (GPT), "final_norm", "lm_head" (untied), "layers": [one
dict per layer]}. Files and checkpoints hold the same tree with the layers stacked on a leading axis
("stacked" layout, what loaders return); `unstack_layers` / `stack_layers` convert. Both keep the
model layout (separate q, k, v, gate, up); the forward computes in the compute layout, those fused
into one matmul each (projections.py), which a pipeline stage makes once where it places params;
under FP8 the compute layout also stores the projections and an untied LM head as e4m3 (fp8.py).

Einsum letters: T tokens, H hidden, N query heads, K kv heads, D head dim, F ffn, V vocab, S sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import ModelConfig, ModelFamily, RopeScaling
from orca_jax.lora import ops as lora_ops
from orca_jax.models.attention import (AttentionMetadata, KVCache, LayerKernels, LayerKV, PackedCausal,
                                       RaggedAttentionFn, empty_layer_kv, packed_causal_attention,
                                       paged_attention)
from orca_jax.models import fp8
from orca_jax.models.projections import fuse_projections, split_layer

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
        if self.has_variable("params", "weight"):  # stored as FP8 (Quantization.FP8, models/fp8.py)
            y = fp8.linear(x, self.get_variable("params", "weight"), self.get_variable("params", "weight_scale"))
        else:
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
    rope_write_kv: Callable | None = None  # LayerKernels.rope_write_kv; None: jnp RoPE and scatters

    @nn.compact
    def __call__(self, x, positions, layer_kv: LayerKV | None, meta: AttentionMetadata | PackedCausal, lora=None,
                 lora_tokens: lora_ops.LoRATokens | None = None):
        cfg = self.config
        h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = n // k  # query heads per KV head
        t = x.shape[0]
        qkv_bias = cfg.family is ModelFamily.GPT or cfg.qkv_bias  # Qwen2: q/k/v biases, no o bias
        # One matmul for q, k and v (see fuse_projections): KV group j holds its G query heads, then
        # its key, then its value, so a tensor shard of whole groups owns everything it attends with.
        qkv = Linear(cfg, "TH,HKGD->TKGD", (h, k, g + 2, d), (k, g + 2, d), qkv_bias, name="qkv")(x)
        if lora is not None:  # this layer's slice of the adapter table (lora/layout.py)
            qkv = lora_ops.add_qkv(qkv, x, lora["qkv"], lora_tokens)
        if self.rope_write_kv is not None and isinstance(meta, AttentionMetadata):
            inv_freq = None
            if cfg.family is ModelFamily.LLAMA:
                inv_freq = jnp.asarray(rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling))  # f32[D/2]
            q, k_pages, v_pages = self.rope_write_kv(qkv, positions, meta.slot_mapping, inv_freq, layer_kv.k,
                                                     layer_kv.v)
            layer_kv = LayerKV(k_pages, v_pages)
            out = self.attention_fn(q, layer_kv.k, layer_kv.v, meta.cu_q_lens, meta.kv_lens, meta.page_table,
                                    meta.num_seqs)
        else:
            qk, value = qkv[:, :, :g + 1], qkv[:, :, g + 1]  # [T, K, G + 1, D], [T, K, D]
            if cfg.family is ModelFamily.LLAMA:  # one rotation for queries and keys alike
                qk = apply_rope(qk.reshape(t, k * (g + 1), d), positions, cfg.rope_theta,
                                cfg.rope_scaling).reshape(t, k, g + 1, d)
            q = qk[:, :, :g].reshape(t, n, d)  # query head j * G + i is group j's i-th: [T, N, D]
            if isinstance(meta, PackedCausal):  # a training batch: no KV pages (layer_kv is None)
                out = packed_causal_attention(q, qk[:, :, g], value, meta)
            else:
                out, layer_kv = paged_attention(q, qk[:, :, g], value, layer_kv, meta, self.attention_fn)
        y = Linear(cfg, "TND,NDH->TH", (n, d, h), (h,), name="o")(out)
        if lora is not None:
            y = lora_ops.add_o(y, out, lora["o"], lora_tokens)
        return y, layer_kv


class Mlp(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, lora=None, lora_tokens: lora_ops.LoRATokens | None = None):  # [T, H] -> [T, H]
        cfg = self.config
        h, f = cfg.hidden_size, cfg.ffn_size
        if cfg.family is ModelFamily.GPT:
            up = Linear(cfg, "TH,HF->TF", (h, f), (f,), name="up")(x)
            if lora is not None:
                up = lora_ops.add_in(up, x, lora["up"], lora_tokens)
            act = jax.nn.gelu(up, approximate=True)
        else:  # gate and up in one matmul (see fuse_projections)
            gate_up = Linear(cfg, "TH,HCF->TCF", (h, 2, f), (2, f), name="gate_up")(x)  # [T, 2, F]
            if lora is not None:
                gate_up = lora_ops.add_gate_up(gate_up, x, lora["gate_up"], lora_tokens)
            act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        y = Linear(cfg, "TF,FH->TH", (f, h), (h,), name="down")(act)
        if lora is not None:
            y = lora_ops.add_in(y, act, lora["down"], lora_tokens)
        return y


class Block(nn.Module):
    """One pre-norm transformer layer: [T, H] and its K/V pages in, [T, H] and the pages out."""

    config: ModelConfig
    attention_fn: RaggedAttentionFn
    kernels: LayerKernels | None = None  # serving's kernels in place of XLA's ops; None: jnp only

    @nn.compact
    def __call__(self, x, positions, layer_kv: LayerKV | None, meta: AttentionMetadata | PackedCausal, lora=None,
                 lora_tokens: lora_ops.LoRATokens | None = None):
        """`lora`: this layer of the adapter table (None: no adapter term), `lora_tokens`: each token's slot."""
        # Training and prompt logprobs (PackedCausal) keep the jnp ops: they need gradients or run rarely.
        kernels = self.kernels if isinstance(meta, AttentionMetadata) else None
        attn_out, layer_kv = Attention(self.config, self.attention_fn,
                                       None if kernels is None else kernels.rope_write_kv, name="attn")(
            Norm(self.config, name="attn_norm")(x), positions, layer_kv, meta,
            None if lora is None else lora["attn"], lora_tokens)
        x = x + attn_out
        x = x + Mlp(self.config, name="mlp")(Norm(self.config, name="mlp_norm")(x),
                                             None if lora is None else lora["mlp"], lora_tokens)
        return x, layer_kv


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The ragged forward pass as three pieces a pipeline stage can pick from: embed, layers, logits."""

    config: ModelConfig
    attention_fn: RaggedAttentionFn
    # The real vocabulary when config.vocab_size is padded for tensor parallelism (tensor_plan.py):
    # logits at or past it are masked to -inf, so sampling, argmax and logprobs never see them.
    real_vocab_size: int | None = None
    # Device KV heads per model KV head (tensor_plan.py replicates them so every shard owns whole ones):
    # what an adapter trained on this decoder maps back to the model's own shapes with.
    kv_repeat: int = 1
    kernels: LayerKernels | None = None  # the serving forward's kernels (Block); None: XLA's ops
    # The attention for batches whose every request feeds one token (None: attention_fn's): one pass
    # of the Pallas kernel where a mixed batch needs two (ragged_attention_tiles.plan_passes).
    decode_attention_fn: RaggedAttentionFn | None = None

    @property
    def block(self) -> Block:
        return Block(self.config, self.attention_fn, self.kernels)

    @property
    def has_decode_attention(self) -> bool:
        """Whether decode batches get programs of their own (for_decode)."""
        return self.decode_attention_fn is not None

    def for_decode(self) -> "Decoder":
        """This decoder for decode batches: its decode attention in place of the general one."""
        if self.decode_attention_fn is None:
            return self
        return dataclasses.replace(self, attention_fn=self.decode_attention_fn, decode_attention_fn=None)

    def embed(self, params, token_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """i32[T] token ids and positions -> [T, H] hidden states."""
        x = params["embed"][token_ids]  # [T, H]
        if self.config.family is ModelFamily.GPT:
            x = x + params["pos_embed"][positions]
        return x

    def layers(self, layer_params, kv: KVCache, x: jax.Array, positions: jax.Array,
               meta: AttentionMetadata, lora_table=None,
               lora_tokens: lora_ops.LoRATokens | None = None) -> tuple[jax.Array, KVCache]:
        """Run layers in order (one compute-layout params dict and one LayerKV each); a Python loop,
        unrolled by jit. `lora_table`: one adapter-table layer each (None: no adapter term)."""
        if len(layer_params) != len(kv):
            raise ValueError(f"{len(layer_params)} layers of params but {len(kv)} of KV pages")
        lora_layers = [None] * len(kv) if lora_table is None else lora_table
        new_kv = []
        for params, layer_kv, lora in zip(layer_params, kv, lora_layers):
            x, layer_kv = apply_block(self, params, x, positions, layer_kv, meta, lora, lora_tokens)
            new_kv.append(layer_kv)
        return x, tuple(new_kv)

    def logits(self, params, x: jax.Array) -> jax.Array:
        """[S, H] hidden states at the rows to sample from -> f32[S, V] (padded V: -inf past the real one)."""
        x = Norm(self.config).apply({"params": params["final_norm"]}, x)
        if self.config.tie_embeddings:
            logits = jnp.einsum("SH,VH->SV", x, params["embed"], preferred_element_type=jnp.float32)
        elif isinstance(params["lm_head"], dict):  # stored as FP8 (fp8.quantize_lm_head): e4m3 [V, H], f32 [V]
            head = params["lm_head"]
            logits = fp8.linear(x, head["weight"], head["weight_scale"], out_dtype=jnp.float32)
        else:
            logits = jnp.einsum("SH,HV->SV", x, params["lm_head"], preferred_element_type=jnp.float32)
        width = logits.shape[-1]
        if self.real_vocab_size is not None and self.real_vocab_size < width:
            logits = jnp.where(jnp.arange(width) < self.real_vocab_size, logits, -jnp.inf)
        return logits


@functools.partial(jax.jit, static_argnums=0)
def apply_block(decoder: Decoder, params, x: jax.Array, positions: jax.Array, layer_kv: LayerKV,
                meta: AttentionMetadata, lora=None,
                lora_tokens: lora_ops.LoRATokens | None = None) -> tuple[jax.Array, LayerKV]:  # x: [T, H], positions: i32[T]
    """One layer, as its own jitted function: every layer has the same shapes, so a forward program
    traces and lowers the block once and calls it per layer (XLA inlines the calls again). Tracing
    32 unrolled copies of it held the GIL for seconds per program and serialized the precompile
    threads: the cold start was mostly that."""
    return decoder.block.apply({"params": params}, x, positions, layer_kv, meta, lora, lora_tokens)


def empty_cache(config: ModelConfig, num_pages: int, page_size: int,
                layers: range | None = None) -> KVCache:
    """Zeroed K/V pages for each layer (all layers, or a stage's range): [KVH, num_pages, page_size, D]."""
    layers = range(config.num_layers) if layers is None else layers
    return tuple(empty_layer_kv(config.num_kv_heads, num_pages, page_size, config.head_dim,
                                jnp.dtype(config.kv_dtype_name)) for _ in layers)


def _dummy_inputs(config: ModelConfig):
    x = jnp.zeros((1, config.hidden_size), _dtype(config))
    layer_kv = empty_layer_kv(config.num_kv_heads, 2, 1, config.head_dim, _dtype(config))
    meta = AttentionMetadata(
        cu_q_lens=jnp.array([0, 1], jnp.int32), kv_lens=jnp.array([1], jnp.int32),
        page_table=jnp.array([[1]], jnp.int32), slot_mapping=jnp.array([1], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32))
    return x, jnp.zeros((1,), jnp.int32), layer_kv, meta


def _init_layer(config: ModelConfig, key: jax.Array):
    """One layer's random params in the model layout (Flax's init runs the block once on dummy inputs;
    XLA drops that)."""
    from orca_jax.kernels.ragged_attention import ragged_attention_reference  # init runs it once

    params = Block(config, ragged_attention_reference).init(key, *_dummy_inputs(config))["params"]
    return split_layer(params)  # drawn as the block declares them, returned in the model layout


def _init_rest(config: ModelConfig, keys: jax.Array, names) -> dict:
    """The params outside the layers that `names` lists (embed, final_norm, pos_embed, lm_head)."""
    dtype, h = _dtype(config), config.hidden_size
    makers = {
        "embed": lambda: _init_weight(keys[0], (config.vocab_size, h), dtype),
        "final_norm": lambda: Norm(config).init(keys[1], _dummy_inputs(config)[0])["params"],
        "pos_embed": lambda: nn.initializers.normal(0.01)(keys[2], (config.max_seq_len, h), dtype),
        "lm_head": lambda: _init_weight(jax.random.fold_in(keys[0], 1), (h, config.vocab_size), dtype),
    }
    return {name: makers[name]() for name in names}


def _top_level_names(config: ModelConfig) -> tuple[str, ...]:
    names = ("embed", "final_norm")
    names += ("pos_embed",) if config.family is ModelFamily.GPT else ()
    return names + (() if config.tie_embeddings else ("lm_head",))


def _param_keys(config: ModelConfig, seed_key: jax.Array) -> jax.Array:
    """keys[0..2] for the params outside the layers, keys[3 + i] for layer i."""
    return jax.random.split(seed_key, config.num_layers + 3)


def _init_all(config: ModelConfig, key: jax.Array):
    """Random params in the device layout (one dict per layer), in the config's dtype."""
    keys = _param_keys(config, key)
    params = _init_rest(config, keys, _top_level_names(config))
    params["layers"] = [_init_layer(config, keys[3 + i]) for i in range(config.num_layers)]
    return params


def _shapes_of(config: ModelConfig, layout=lambda params: params):
    """The params tree's ShapeDtypeStructs in `layout`, computed without allocating anything.

    Every layer has the same shapes, so one is traced and repeated: tracing Flax's init of all 32
    layers of llama-8b took 2.4 s of a 10 s warm start."""

    def one_layer_model():
        keys = _param_keys(config, jax.random.key(0))
        params = _init_rest(config, keys, _top_level_names(config))
        params["layers"] = [_init_layer(config, keys[3])]
        return layout(params)

    shapes = jax.eval_shape(one_layer_model)
    shapes["layers"] = shapes["layers"] * config.num_layers
    return shapes


def param_shapes(config: ModelConfig):
    """The device-layout params tree as ShapeDtypeStructs, computed without allocating anything."""
    return _shapes_of(config)


def to_compute_layout(params, config: ModelConfig):
    """A model-layout params tree (or part of one) in the compute layout the forward takes: projections
    fused (projections.py), then stored as FP8 under Quantization.FP8 (fp8.py), the LM head too where
    config.lm_head_quantized."""
    params = fp8.quantize_projections(fuse_projections(params), config.quantization)
    return fp8.quantize_lm_head(params) if config.lm_head_quantized else params


def compute_param_shapes(config: ModelConfig):
    """param_shapes in the compute layout the forward takes (to_compute_layout)."""
    return _shapes_of(config, lambda params: to_compute_layout(params, config))


def stacked_param_shapes(config: ModelConfig):
    """The stacked (file) layout: what loaders return and checkpoints hold; layers on a leading axis."""
    shapes = param_shapes(config)
    layer = shapes["layers"][0]
    stacked = dict(shapes)
    stacked["layers"] = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct((config.num_layers, *s.shape), s.dtype), layer)
    return stacked


def init_params(config: ModelConfig, seed: int = 0, out_shardings=None, adapt=None, select=None):
    """Random weights made on device inside jit, in the config's dtype (the paper's evaluation setup).

    Made piece by piece: one program draws a layer and runs once per layer, one draws the rest, so
    compile time does not grow with depth (one program for all of llama-8b took 105 s to compile on
    an H100). Each piece comes from its own key, so the weights are the same whatever part is made.
    `adapt` (e.g. TensorPlan.adapt_params, which goes by parameter names) reshapes each piece inside
    its program, so the weights are drawn for `config` whatever the device shapes: every mesh gets the
    same model. `select(params) -> subtree` keeps a part (a pipeline stage's); only that part is made.
    `out_shardings` matches the selected tree.
    """
    adapt = adapt or (lambda tree: tree)
    keys = _param_keys(config, jax.random.key(seed))
    # Which pieces `select` keeps, found by running it on a tree of the pieces' names.
    names = _top_level_names(config)
    skeleton = {name: name for name in names} | {"layers": list(range(config.num_layers))}
    chosen = skeleton if select is None else select(skeleton)
    rest_names = tuple(name for name in names if name in chosen)

    def jit(fn, shardings):
        return jax.jit(fn) if out_shardings is None else jax.jit(fn, out_shardings=shardings)

    rest = jit(lambda k: adapt(_init_rest(config, k, rest_names)),
               None if out_shardings is None else {n: out_shardings[n] for n in rest_names})(keys)
    layer_shardings = None if out_shardings is None else out_shardings["layers"]
    make_layer = {}  # one jitted program per distinct sharding (all layers share one in practice)
    layers = []
    for j, i in enumerate(chosen["layers"]):
        shardings = None if layer_shardings is None else layer_shardings[j]
        cache_key = None if shardings is None else tuple(jax.tree_util.tree_leaves(shardings))
        if cache_key not in make_layer:
            make_layer[cache_key] = jit(lambda k: adapt({"layers": [_init_layer(config, k)]})["layers"][0],
                                        shardings)
        layers.append(make_layer[cache_key](keys[3 + i]))
    return {**rest, "layers": layers}


def unstack_layers(params):
    """Stacked layout -> device layout: layer i's arrays are views x[i] (no copy for numpy input)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    num_layers = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = dict(params)
    out["layers"] = [jax.tree_util.tree_map(lambda x, i=i: x[i], layers) for i in range(num_layers)]
    return out


def stack_layers(params):
    """Device layout -> stacked layout, on the host (numpy), for checkpoints and checks."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)
    return out
