"""Save params once on one device; restore them sharded straight onto other meshes (8 fake CPU devices), and back.

Meshes (stage, tensor) from (1, 1) to (2, 4), on a GQA Llama whose 2 KV heads are replicated at tp=4
and a GPT with biases and an odd tied vocabulary; every restored array must sit on its own stage's
devices with the rules' sharding, equal the adapted originals, and give the originals back.
"""

import json
import textwrap

import pytest

from mesh_helpers import run_on_fake_devices

MESHES = [(1, 1), (1, 4), (2, 2), (2, 4)]

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile, os
    import jax, numpy as np
    from jax.sharding import NamedSharding
    from orca_jax.config import (CacheConfig, EngineConfig, ModelConfig, ModelFamily, ParallelConfig,
                                 SchedulerConfig)
    from orca_jax.engine import Engine
    from orca_jax.models import decoder, weights
    from orca_jax.sharding import rules
    from orca_jax.sharding.checkpoint import gather_model_params, restore_sharded, stage_meshes
    from orca_jax.sharding.mesh import make_mesh
    from orca_jax.sharding.tensor_plan import plan_for
    from orca_jax.models.loader import LoadedModel
    from orca_jax.request import SamplingParams
    from orca_jax.tokenizer import ByteTokenizer
    sys.path.insert(0, "tests")
    from engine_helpers import drain

    MODELS = {
        "llama-gqa": ModelConfig(family=ModelFamily.LLAMA, vocab_size=255, hidden_size=32, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=4, ffn_size=64, max_seq_len=64,
                                 tie_embeddings=False),
        "gpt-odd-vocab": ModelConfig(family=ModelFamily.GPT, vocab_size=257, hidden_size=32, num_layers=4,
                                     num_heads=4, num_kv_heads=4, head_dim=8, ffn_size=64, max_seq_len=64),
    }
    meshes = json.loads(sys.argv[1])
    out = {}
    root = tempfile.mkdtemp()
    for name, config in MODELS.items():
        original = decoder.stack_layers(decoder.init_params(config, seed=1))  # numpy, stacked
        path = os.path.join(root, name)
        weights.save_params(path, original)  # once, from one device's arrays
        total = sum(x.nbytes for x in jax.tree_util.tree_leaves(original))
        for pp, tp in meshes:
            mesh = make_mesh(ParallelConfig(num_stages=pp, tensor_parallel=tp))
            plan = plan_for(config, tp)
            restored = restore_sharded(path, config, mesh)
            subs = stage_meshes(mesh)
            placed = True
            for i, layer in enumerate(restored["layers"]):
                for p, x in jax.tree_util.tree_leaves_with_path(layer):
                    want = NamedSharding(subs[i // (config.num_layers // pp)],
                                         rules.PARAM_SPECS["layers/" + rules._path_name(p)])
                    placed &= x.sharding == want
            for key in ("embed", "lm_head"):
                if key in restored:
                    placed &= restored[key].sharding == NamedSharding(mesh, rules.PARAM_SPECS[key])
            per_device = {}
            for x in jax.tree_util.tree_leaves(restored):
                for shard in x.addressable_shards:
                    per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
            adapted = plan.adapt_params(decoder.unstack_layers(original))
            equal_adapted = all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
                lambda a, b: bool(np.array_equal(np.asarray(a), b)), restored, adapted)))
            back = gather_model_params(restored, config, tp)
            equal_back = all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
                lambda a, b: a.shape == b.shape and bool(np.array_equal(a, b)), back, original)))
            out[f"{name}/{pp}x{tp}"] = {
                "placed": bool(placed), "equal_adapted": equal_adapted, "equal_back": equal_back,
                "devices": len(per_device), "max_device_fraction": max(per_device.values()) / total,
                "embed_rows": restored["embed"].shape[0], "kv_heads": restored["layers"][0]["attn"]["k"]["kernel"].shape[1]}
        if name == "llama-gqa":  # the runner takes restored params as they are, and serves the same tokens
            tokens = {}
            for tp, params in ((1, original), (4, restore_sharded(path, config, make_mesh(ParallelConfig(tensor_parallel=4))))):
                engine = Engine(EngineConfig(model=name, cache=CacheConfig(page_size=4, num_pages=64),
                                             scheduler=SchedulerConfig(max_batch_size=4, max_num_batched_tokens=8),
                                             parallel=ParallelConfig(tensor_parallel=tp)),
                                LoadedModel(config, params, ByteTokenizer()))
                engine.add_request([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=6, ignore_eos=True), request_id="a")
                tokens[tp] = drain(engine)["a"]
            out["served_from_restore"] = tokens
        try:
            restore_sharded(path, MODELS["llama-gqa" if name != "llama-gqa" else "gpt-odd-vocab"],
                            make_mesh(ParallelConfig(tensor_parallel=2)))
            out[f"{name}/wrong_config"] = "restored"
        except weights.WeightsError as err:
            out[f"{name}/wrong_config"] = str(err)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(8, "-c", SCRIPT, json.dumps(MESHES))


@pytest.mark.parametrize("pp,tp", MESHES)
@pytest.mark.parametrize("model,vocab,kv_heads", [("llama-gqa", 255, 2), ("gpt-odd-vocab", 257, 4)])
def test_restore_onto_a_mesh_equals_the_saved_params(results, model, vocab, kv_heads, pp, tp):
    r = results[f"{model}/{pp}x{tp}"]
    assert r["placed"] and r["devices"] == pp * tp
    assert r["equal_adapted"] and r["equal_back"]
    assert r["embed_rows"] == -(-vocab // tp) * tp
    assert r["kv_heads"] == max(kv_heads, tp)
    if pp * tp > 1:  # no device holds the whole model (the norms and biases it replicates are small)
        assert r["max_device_fraction"] < 0.75


def test_a_checkpoint_of_another_model_is_refused(results):
    assert "do not fit the model config" in results["llama-gqa/wrong_config"]
    assert "do not fit the model config" in results["gpt-odd-vocab/wrong_config"]


def test_the_runner_serves_restored_params_as_they_are(results):
    served = results["served_from_restore"]
    assert len(served["1"]) == 6 and served["4"] == served["1"]
