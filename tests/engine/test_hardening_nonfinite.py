"""A request whose logits turn non-finite ends with an error (not its doing: a 500) and poisons
nobody: neither the batch beside it nor the next request on the pages it wrote NaN into (tiny-llama,
fp32, CPU).

Where NaN used to spread: attention weighted the stale K/V of a reused page by 0 (a freed page still
held the NaN K/V of the request before), and 0 x NaN = NaN. One adapter slot's NaN:
tests/lora/test_hardening_nonfinite.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine.core import Engine
from orca_jax.kernels.ragged_attention_jnp import ragged_attention_jnp
from orca_jax.models import presets
from orca_jax.models.loader import LoadedModel
from orca_jax.models.weights import expected_shapes
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.app import create_app
from orca_jax.tokenizer import ByteTokenizer

from tests.helpers.engines import drain
from tests.helpers.server import asgi_client

POISON = 200  # the token whose embedding row is NaN (never generated: a healthy request must not feed it)
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias=((POISON, -100.0),))


def test_attention_ignores_nan_left_in_the_unused_slots_of_its_pages():
    rng = np.random.default_rng(0)
    kv_heads, num_pages, page_size, d, heads = 2, 6, 4, 8, 4
    k = rng.standard_normal((kv_heads, num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((3, heads, d)), jnp.float32)
    args = (jnp.asarray([0, 3], jnp.int32), jnp.asarray([6], jnp.int32),  # 3 new tokens, 6 in the cache
            jnp.asarray([[2, 3, 0]], jnp.int32), jnp.asarray([1], jnp.int32))
    clean = ragged_attention_jnp(q, jnp.asarray(k), jnp.asarray(v), *args)
    k[:, 3, 2:] = v[:, 3, 2:] = np.nan  # page 3 past position 5: stale
    k[:, 0] = v[:, 0] = np.nan  # page 0, the scratch page padding writes into
    stale = ragged_attention_jnp(q, jnp.asarray(k), jnp.asarray(v), *args)
    np.testing.assert_array_equal(np.asarray(stale), np.asarray(clean))


def _untied():
    """tiny-llama with its own output projection: a NaN embedding row then poisons only the requests
    that feed that token (tied, it would be every logit's column)."""
    return dataclasses.replace(presets.PRESETS["tiny-llama"], tie_embeddings=False)


def _params_with_a_nan_token(config) -> dict:
    """Random weights (norm scales 1) whose embedding row POISON is NaN."""
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    shapes = expected_shapes(config)
    params = jax.tree_util.tree_map_with_path(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))
    params["embed"][POISON] = np.nan
    return params


def _engine(params, config) -> Engine:
    loaded = LoadedModel(config, params, ByteTokenizer(config.eos_token_ids, config.bos_token_id))
    return Engine(EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=4, num_pages=64),
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                               attention=AttentionBackend.JNP, precompile=False, compilation_cache_dir=None),
                  loaded)


def test_a_request_whose_logits_turn_nan_ends_with_an_error_and_poisons_nobody():
    config = _untied()
    params = _params_with_a_nan_token(config)
    clean_engine = _engine(params, config)
    other, later = [7, 8, 9], [11, 12]
    for prompt, name in ((other, "other"), (later, "later")):
        clean_engine.add_request(prompt, GREEDY, request_id=name)
    expected = drain(clean_engine)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in expected.values())

    engine = _engine(params, config)
    engine.add_request([5, 6, POISON, 7, 8, 9, 10, 11, 12, 13], GREEDY, request_id="poisoned")
    engine.add_request(other, GREEDY, request_id="other")
    outputs = {}
    while engine.has_unfinished():
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
    poisoned = outputs["poisoned"]
    assert poisoned.finish_reason == "error" and poisoned.output_token_ids == []
    assert "not finite" in poisoned.error.message and not poisoned.error.caused_by_request
    assert outputs["other"].output_token_ids == expected["other"]
    # The next request takes the pages the poisoned one wrote NaN K/V into (their unused slots too).
    engine.add_request(later, GREEDY, request_id="later")
    assert drain(engine)["later"] == expected["later"]
    assert engine.kv.num_used_pages == 0


def test_the_engine_error_is_a_500_naming_it_streamed_or_not():
    config = _untied()
    engine = _engine(_params_with_a_nan_token(config), config)
    app = create_app(engine, served_model_name="tiny")
    poisoned = [5, 6, POISON, 7]

    async def scenario():
        async with asgi_client(app) as client:
            no_poison = {"logit_bias": {str(POISON): -100}, "temperature": 0}
            answer = await client.post("/v1/completions", json={"prompt": poisoned, "max_tokens": 3})
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["code"] == "generation_failed"
            assert "not finite" in answer.json()["error"]["message"]
            streamed = await client.post("/v1/completions", json={"prompt": poisoned, "max_tokens": 3,
                                                                  "stream": True})
            events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert '"generation_failed"' in events[-2] and events[-1] == "data: [DONE]"
            fine = await client.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 3, **no_poison})
            assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] == "length"

    asyncio.run(scenario())
