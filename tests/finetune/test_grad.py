"""The fine-tuning step's LoRA gradient equals transformers + peft's and a plain jax.grad reference's on
the same batch (fp32, tiny models written by save_pretrained), packing included."""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.config import AttentionBackend, LoRAConfig
from orca_jax.finetune.adapter_params import read_peft
from orca_jax.finetune.model import grad_fn, loss_sums
from orca_jax.models.loader import load_model

from tests.helpers.engines import tiny_engine
from tests.helpers.finetune import EXAMPLES, packed_batch, padded_hf_batch
from tests.helpers.lora import write_base
from tests.helpers.models import hf_offline

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
hf_offline()

TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}
# Measured (fp32 on CPU): max |ours - theirs| / max |theirs| 8.1e-7 against peft (Llama and GPT-2),
# 1.3e-6 against the jnp reference.
RELATIVE_BOUND = 1e-5


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request, tmp_path_factory):
    """(kind, peft model with random A and B, our engine, our trained tree, its spec)."""
    kind = request.param
    base_dir = str(tmp_path_factory.mktemp(kind))
    base = write_base(base_dir, kind)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], init_lora_weights=False,
                             fan_in_fan_out=kind == "gpt2")
    model = peft.get_peft_model(copy.deepcopy(base), config)
    adapter_dir = str(tmp_path_factory.mktemp(f"{kind}-adapter"))
    model.save_pretrained(adapter_dir)
    engine = tiny_engine("smollm2-135m", loaded=load_model(base_dir), page_size=8, num_pages=64,
                         attention=AttentionBackend.JNP, lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    adapter, spec = read_peft(adapter_dir, "start", engine.model_config)
    return kind, model, engine, adapter, spec


def peft_grads(model, examples=EXAMPLES) -> tuple[float, dict]:
    """transformers' mean loss over the completion tokens and d loss / d each lora weight, by
    (layer, module key, "a" | "b")."""
    ids, mask, labels = padded_hf_batch(examples)
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        match = re.search(r"(?:layers|h)\.(\d+)\.(.+)\.lora_([AB])\.default\.weight", name)
        if match:
            grads[int(match[1]), match[2], match[3].lower()] = param.grad.numpy()
    return float(loss), grads


def test_gradient_equals_peft(setup):
    kind, model, engine, adapter, spec = setup
    stage = engine.runner.stages[0]
    batch = packed_batch()
    (loss_sum, count), grads = jax.jit(grad_fn(stage.model, spec.scaling))(adapter, stage.params, batch)
    hf_loss, hf_grads = peft_grads(model)
    assert float(count) == sum(len(c) for _, c in EXAMPLES)
    assert float(loss_sum / count) == pytest.approx(hf_loss, rel=1e-5)
    assert len(hf_grads) == 2 * sum(len(layer) for layer in adapter["layers"])
    scale = max(np.abs(g).max() for g in hf_grads.values())
    for (layer, key, which), expected in hf_grads.items():
        ours = np.asarray(grads["layers"][layer][key][which]) / float(count)
        assert ours.shape == expected.shape, (layer, key, which)
        np.testing.assert_allclose(ours, expected, atol=RELATIVE_BOUND * scale, err_msg=f"{layer} {key} {which}")


def test_remat_changes_nothing(setup):
    _, _, engine, adapter, spec = setup
    stage = engine.runner.stages[0]
    batch = packed_batch()
    with_remat = jax.jit(grad_fn(stage.model, spec.scaling, remat=True))(adapter, stage.params, batch)
    without = jax.jit(grad_fn(stage.model, spec.scaling, remat=False))(adapter, stage.params, batch)
    for a, b in zip(jax.tree_util.tree_leaves(with_remat), jax.tree_util.tree_leaves(without)):
        a, b = np.asarray(a), np.asarray(b)
        # Recomputed or kept, the same sums, added in an order the compiler picks: on an H100 they
        # differed by up to 8e-7 on leaves whose largest entries are 0.28 and more (3e-6 of them).
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5 * np.abs(b).max())


# ---- a plain jax.grad reference: Llama written out in jnp, one padded row per example -------------

def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x, theta):  # x [B, L, heads, D], rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv  # [L, D/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_loss(adapter, p, cfg, scaling, ids, labels, weights):
    """Mean loss over completion tokens. p: the loaded (stacked, model layout) params; adapter: the
    peft-layout tree; ids/labels/weights [B, L], one example per row, right-padded."""
    n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, l = ids.shape

    def lora(i, key, h):
        if key not in adapter["layers"][i]:
            return 0.0
        w = adapter["layers"][i][key]
        return (h @ w["a"].T) @ w["b"].T * scaling

    x = p["embed"][ids]
    causal = jnp.tril(jnp.ones((l, l), bool))
    for i in range(cfg.num_layers):
        lp = jax.tree_util.tree_map(lambda a: a[i], p["layers"])
        h = _rms(x, lp["attn_norm"]["scale"], cfg.norm_eps)
        flat = lambda w: w.reshape(cfg.hidden_size, -1)
        q = (h @ flat(lp["attn"]["q"]["kernel"]) + lora(i, "self_attn.q_proj", h)).reshape(b, l, n, d)
        kk = (h @ flat(lp["attn"]["k"]["kernel"]) + lora(i, "self_attn.k_proj", h)).reshape(b, l, k, d)
        v = (h @ flat(lp["attn"]["v"]["kernel"]) + lora(i, "self_attn.v_proj", h)).reshape(b, l, k, d)
        q, kk = _rope(q, cfg.rope_theta), _rope(kk, cfg.rope_theta)
        kk, v = jnp.repeat(kk, n // k, axis=2), jnp.repeat(v, n // k, axis=2)
        s = jnp.einsum("bqnd,bknd->bnqk", q, kk) / np.sqrt(d)
        s = jnp.where(causal, s, -1e30)
        att = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, -1), v).reshape(b, l, n * d)
        x = x + att @ lp["attn"]["o"]["kernel"].reshape(n * d, -1) + lora(i, "self_attn.o_proj", att)
        h = _rms(x, lp["mlp_norm"]["scale"], cfg.norm_eps)
        gate = h @ lp["mlp"]["gate"]["kernel"] + lora(i, "mlp.gate_proj", h)
        up = h @ lp["mlp"]["up"]["kernel"] + lora(i, "mlp.up_proj", h)
        act = jax.nn.silu(gate) * up
        x = x + act @ lp["mlp"]["down"]["kernel"] + lora(i, "mlp.down_proj", act)
    logits = _rms(x, p["final_norm"]["scale"], cfg.norm_eps) @ p["lm_head"]
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)


def test_gradient_equals_plain_jax_grad(setup, tmp_path):
    kind, _, engine, adapter, spec = setup
    if kind != "llama":
        pytest.skip("the written-out reference is Llama's")
    loaded = engine_loaded_params(engine)
    one_per_row = packed_batch(rows=((0,), (1,), (2,)))
    reference = jax.jit(jax.grad(reference_loss), static_argnums=(2, 3))
    expected = reference(adapter, loaded, engine.model_config, spec.scaling,
                         one_per_row.token_ids, one_per_row.labels, one_per_row.weights)
    stage = engine.runner.stages[0]
    packed = packed_batch()  # two examples share a row here
    (_, count), grads = jax.jit(grad_fn(stage.model, spec.scaling))(adapter, stage.params, packed)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(expected))
    for ours, ref in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(ours) / float(count), np.asarray(ref), atol=RELATIVE_BOUND * scale)


def engine_loaded_params(engine):
    """The engine's weights back in the stacked model layout (as the loader returned them)."""
    from orca_jax.models.decoder import stack_layers
    from orca_jax.models.projections import split_projections

    return stack_layers(split_projections(jax.device_get(engine.runner.stages[0].params)))


def test_zero_b_is_the_base_model(setup):
    """peft's initial state (B = 0): our loss is the base model's, as transformers computes it."""
    _, model, engine, adapter, spec = setup
    stage = engine.runner.stages[0]
    zero_b = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-1].key == "b" else x, adapter)
    loss, count = loss_sums(zero_b, stage.params, packed_batch(), decoder=stage.model, scaling=spec.scaling)
    ids, mask, labels = padded_hf_batch()
    with torch.no_grad(), model.disable_adapter():
        expected = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert float(loss / count) == pytest.approx(expected, rel=1e-5)
