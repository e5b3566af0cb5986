"""One adapter slot's non-finite values never reach another's tokens (tiny-llama, fp32, CPU).

Where NaN used to spread: the adapter term zeroed other slots' values by multiplying by a 0 mask
(0 x NaN = NaN for every token of the batch). The adapter table is kept finite by its one writer
(lora/table.py), so a slot planted with NaN through it reads as zeros. What follows a NaN into the
KV pages and the logits: tests/engine/test_hardening_nonfinite.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.config import LoRAConfig
from orca_jax.lora import LoRARequest
from orca_jax.lora.adapter import LoRAAdapter, LoRAError, random_adapter
from orca_jax.lora.ops import LoRATokens, gate_up_delta, in_delta, o_delta, qkv_delta
from orca_jax.sampling_params import SamplingParams

from tests.helpers.engines import drain, tiny_engine

POISON = 200  # a token no request here feeds or may generate
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias=((POISON, -100.0),))


def _nan_adapter(model, name: str) -> LoRAAdapter:
    clean = random_adapter(model, 4, seed=1, b_std=0.3)
    return LoRAAdapter(name, 4, tuple({p: (np.full_like(a, np.inf), np.full_like(b, np.nan))
                                       for p, (a, b) in layer.items()} for layer in clean.layers))


def test_an_adapter_with_nan_weights_is_refused_by_the_engine():
    engine = tiny_engine(lora=LoRAConfig(max_loras=2, max_lora_rank=8), compilation_cache_dir=None)
    with pytest.raises(LoRAError, match="'bad': layer 0 q: its weights must be finite"):
        engine.add_lora(LoRARequest("bad", 1, "(in memory)"), _nan_adapter(engine.model_config, "bad"))
    assert engine.list_loras() == []


@pytest.mark.parametrize("prompt_len", [3, 20])  # a decode-sized bucket (gathered form) and a dense one
def test_a_slot_planted_with_nan_leaves_the_base_tokens_of_its_batch_unchanged(prompt_len):
    engine = tiny_engine(lora=LoRAConfig(max_loras=2, max_lora_rank=8), async_scheduling=False,
                         compilation_cache_dir=None)
    prompt = list(range(5, 5 + prompt_len))
    engine.add_request(prompt, GREEDY, request_id="alone")
    alone = drain(engine)["alone"]
    lora = LoRARequest("planted", 1, "(in memory)")
    engine.add_lora(lora, random_adapter(engine.model_config, 4, seed=0, name="planted", b_std=0.3))
    engine.add_request(prompt, GREEDY, request_id="adapted", lora_request=lora)
    engine.add_request(prompt, GREEDY, request_id="base")
    engine.step()  # both admitted, the adapter uploaded to its slot and the prompts run
    slot = engine.lora.slots.slot_of(lora.lora_int_id)
    engine.drain()  # the next batch's launches are done before the runner is called from here
    # Planted past the manager's check, through the engine's own upload: every weight inf or NaN.
    engine.runner.load_lora(slot, _nan_adapter(engine.model_config, "planted"))
    done = drain(engine)
    assert done["base"] == alone
    table = engine.runner.stages[0].lora.table
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(table))


def _table(rng, shapes: dict) -> dict:
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.mark.parametrize("small", [False, True])  # the dense form of large buckets, the gathered one
def test_the_adapter_term_selects_each_tokens_slot_rather_than_multiplying_by_zero(small):
    """Slot 1 (table row 0, which tokens without an adapter read in the gathered form) holds inf in A
    (and, for the gathered form, NaN in B too); tokens on the base or on slot 2 get exactly the term
    they get when slot 1 is clean."""
    rng = np.random.default_rng(0)
    t = 6 if small else 12
    h, k, g, d, f, m, r = 16, 2, 2, 4, 24, 2, 3
    lora_slots = jnp.asarray(([0, 2] * t)[:t], jnp.int32)  # nobody uses slot 1
    tokens = LoRATokens.of(lora_slots, m, jnp.float32)
    assert (tokens.rows is not None) == small
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    cases = [(qkv_delta, x, {"a": (h, 3, m, r), "b_q": (m, r, k, g, d), "b_kv": (2, m, r, k, d)}, 2, 0),
             (o_delta, jnp.asarray(rng.standard_normal((t, k * g, d)), jnp.float32),
              {"a": (k * g, d, m, r), "b": (m, r, h)}, 2, 0),
             (gate_up_delta, x, {"a": (h, 2, m, r), "b": (2, m, r, f)}, 2, 1),
             (in_delta, x, {"a": (h, m, r), "b": (m, r, f)}, 1, 0)]
    for delta, inputs, shapes, a_axis, b_axis in cases:
        clean = _table(rng, shapes)
        poisoned = {name: value.copy() for name, value in clean.items()}
        row = [slice(None)] * poisoned["a"].ndim
        row[a_axis] = 0
        poisoned["a"][tuple(row)] = np.inf
        if small:  # the gathered form reads only each token's own B
            for name in poisoned:
                if name.startswith("b"):
                    axis = b_axis if name != "b_kv" else 1
                    index = [slice(None)] * poisoned[name].ndim
                    index[axis] = 0
                    poisoned[name][tuple(index)] = np.nan
        expected = delta(inputs, {n: jnp.asarray(v) for n, v in clean.items()}, tokens)
        got = delta(inputs, {n: jnp.asarray(v) for n, v in poisoned.items()}, tokens)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=delta.__name__)
