"""Fine-tuning with tensor parallelism, on fake CPU devices: one device is the reference.

- The LoRA gradient at tp = 2 and 4 equals tp = 1's on a GQA model whose 2 KV heads are replicated at
  tp = 4 and whose vocabulary (250) is padded there: the adapter keeps the model's shapes, and each
  replicated head's gradient adds up into the one trained head.
- A whole job through LLM.fine_tune at tp = 4 gives tp = 1's loss curve and adapter, and the adapter's
  greedy answers are the trained ones (served at once through the sharded LoRA table); the job ran
  on KV pages the sharded pool lent it.
One subprocess runs every case (the device count is fixed when jax starts).
"""

import textwrap

import numpy as np
import pytest

from orca_jax.config import EngineConfig, FineTuningConfig, LoRAConfig, ParallelConfig

from tests.helpers.finetune import FAST
from tests.helpers.mesh import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import json, os, tempfile
    import jax
    import numpy as np
    from orca_jax import LLM, SamplingParams
    from orca_jax.config import (AttentionBackend, CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ModelFamily,
                                 ParallelConfig, SchedulerConfig)
    from orca_jax.engine import Engine
    from orca_jax.finetune.adapter_params import init_adapter, read_peft
    from orca_jax.finetune.hparams import LoRASpec, resolve_targets
    from orca_jax.finetune.model import grad_fn
    from orca_jax.models import decoder
    from orca_jax.models.loader import LoadedModel
    from orca_jax.tokenizer import ByteTokenizer
    from tests.helpers.finetune import FAST, RECORDS, TOY, packed_batch

    def model(vocab):
        config = ModelConfig(family=ModelFamily.LLAMA, vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=8,
                             num_kv_heads=2, head_dim=8, ffn_size=128, max_seq_len=128, dtype="float32")
        return LoadedModel(config, decoder.stack_layers(decoder.init_params(config, seed=3)), ByteTokenizer())

    out = {"grad": {}, "job": {}}
    loaded = model(250)
    spec = LoRASpec(4, 8.0, resolve_targets(None, loaded.config.family))
    rng = np.random.default_rng(1)
    adapter = jax.tree_util.tree_map(lambda a: rng.normal(size=a.shape).astype(np.float32) * 0.1,
                                     init_adapter(loaded.config, spec, seed=0))  # B non-zero: every gradient flows
    reference = None
    for tp in (1, 2, 4):
        engine = Engine(EngineConfig(cache=CacheConfig(page_size=4, num_pages=64),
                                     scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                                     parallel=ParallelConfig(tensor_parallel=tp), precompile=False,
                                     attention=AttentionBackend.JNP, lora=LoRAConfig(max_loras=2, max_lora_rank=8)),
                        loaded)
        stage = engine.runner.stages[0]
        (loss, count), grads = jax.jit(grad_fn(stage.model, spec.scaling))(
            jax.device_put(adapter, stage.replicated), stage.params, jax.device_put(packed_batch(), stage.replicated))
        leaves = [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
        reference = reference or leaves
        scale = max(float(np.abs(g).max()) for g in reference)
        out["grad"][tp] = {"loss": float(loss), "count": float(count),
                           "shapes_match": [g.shape for g in leaves] == [g.shape for g in reference],
                           "error": max(float(np.abs(a - b).max()) for a, b in zip(leaves, reference)) / scale,
                           "kv_heads": stage.config.num_kv_heads, "vocab": stage.config.vocab_size}

    loaded = model(256)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    for tp in (1, 4):
        directory = tempfile.mkdtemp()
        llm = LLM("tiny", loaded=loaded, enable_fine_tuning=True, fine_tuning_dir=directory, max_lora_rank=8,
                  attention_backend="jnp", num_kv_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
                  tensor_parallel_size=tp)
        before = [o.token_ids for o in llm.generate([p for p, _ in TOY], greedy, use_tqdm=False)]
        lora = llm.fine_tune(RECORDS, hyperparameters=FAST, lora_rank=8, use_tqdm=False)
        tuner = llm.engine.fine_tuning
        [job] = tuner.jobs()
        curve = [e["data"]["train_loss"] for e in tuner.store.events(job["id"]) if "train_loss" in e["data"]]
        trained, _ = read_peft(lora.lora_path, "x", llm.engine.model_config)
        answers = [o.token_ids for o in llm.generate([p for p, _ in TOY], greedy, lora_request=lora, use_tqdm=False)]
        out["job"][tp] = {"status": job["status"], "curve": curve, "answers": answers, "before": before,
                          "loans": llm.engine.stats().kv_loans_total,
                          "wanted": [llm.tokenizer.encode(c)[:3] for _, c in TOY],
                          "adapter": [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(trained)]}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(4, "-c", SCRIPT)


@pytest.mark.slow  # the fixture's subprocess runs both cases: ~60 s
def test_gradient_equals_one_devices(results):
    grad = results["grad"]
    assert grad["4"]["kv_heads"] == 4 and grad["4"]["vocab"] == 252  # replicated and padded at tp = 4
    for tp in ("2", "4"):
        assert grad[tp]["shapes_match"], tp
        assert grad[tp]["count"] == grad["1"]["count"]
        assert grad[tp]["loss"] == pytest.approx(grad["1"]["loss"], rel=1e-6)
        assert grad[tp]["error"] < 1e-5, (tp, grad[tp]["error"])  # measured 6e-7 (tp 2), 1e-6 (tp 4)


@pytest.mark.slow  # ~40 s of the fixture's: two engines' programs and two jobs
def test_job_at_tp4_equals_one_device(results):
    one, four = results["job"]["1"], results["job"]["4"]
    assert one["status"] == four["status"] == "succeeded"
    # The random tiny model learns the answers while its loss falls by a quarter (measured 5.57 -> 4.31).
    assert len(four["curve"]) == FAST.n_epochs and four["curve"][-1] < 0.85 * four["curve"][0]
    assert four["curve"] == pytest.approx(one["curve"], rel=1e-4)  # measured 5e-7 apart
    for a, b in zip(four["adapter"], one["adapter"]):
        np.testing.assert_allclose(a, b, atol=1e-4)  # measured 3.6e-6 at most, of weights up to 0.25
    assert four["loans"] >= 1  # the job ran on KV pages the sharded pool lent it
    assert four["before"] != four["wanted"]
    assert four["answers"] == four["wanted"] == one["answers"]


def test_pipeline_stages_and_several_processes_are_refused():
    with pytest.raises(ValueError, match="tensor parallelism is supported; pipeline stages are not"):
        EngineConfig(parallel=ParallelConfig(num_stages=2), lora=LoRAConfig(),
                     fine_tuning=FineTuningConfig(directory="/tmp/unused"))
    with pytest.raises(ValueError, match="not supported with several controller processes"):
        EngineConfig(parallel=ParallelConfig(num_processes=2, coordinator_address="localhost:1234"), lora=LoRAConfig(),
                     fine_tuning=FineTuningConfig(directory="/tmp/unused"))
    EngineConfig(parallel=ParallelConfig(tensor_parallel=2), lora=LoRAConfig(),
                 fine_tuning=FineTuningConfig(directory="/tmp/unused"))  # accepted
