"""LoRA adapters with tensor parallelism and pipeline stages, on fake CPU devices: the same logits and
tokens as one device, the table split as rules.LORA_SPECS says, and no all-reduce beyond the base's.

GQA with 2 KV heads at tp=4 (each replicated twice, adapters' k/v B with them) and a GPT model; one
subprocess runs every case.
"""

import textwrap

import numpy as np
import pytest

from tests.helpers.mesh import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import json, re
    import numpy as np
    from orca_jax.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ModelFamily, ParallelConfig,
                                 SchedulerConfig)
    from orca_jax.engine import Engine
    from orca_jax.lora import LoRARequest
    from orca_jax.lora.adapter import random_adapter
    from orca_jax.models import decoder
    from orca_jax.models.loader import LoadedModel
    from orca_jax.sampling_params import SamplingParams
    from orca_jax.tokenizer import ByteTokenizer
    from orca_jax.worker.compilation import ForwardKey
    from tests.helpers.engines import drain
    from tests.helpers.models import prompt_logits

    MODELS = {
        "llama-gqa": ModelConfig(family=ModelFamily.LLAMA, vocab_size=256, hidden_size=64, num_layers=2,
                                 num_heads=8, num_kv_heads=2, head_dim=8, ffn_size=128, max_seq_len=128),
        "gpt": ModelConfig(family=ModelFamily.GPT, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=4, head_dim=16, ffn_size=128, max_seq_len=128),
    }
    PROMPTS = ([5, 6, 7], list(range(10, 30)), [99] * 9, [40, 41])

    def all_reduces(runner, bucket, lora):
        text = runner.compilation.executable(ForwardKey(bucket, 0, lora)).as_text()
        return len(re.findall(r"\\sall-reduce(?:-start)?\\(", text))  # tuple-shaped ones too

    results = {}
    for name, config in MODELS.items():
        params = decoder.stack_layers(decoder.init_params(config, seed=3))
        loaded = LoadedModel(config, params, ByteTokenizer())
        adapters = [random_adapter(config, 4, seed=i, name=f"a{i}", b_std=0.3) for i in range(2)]
        for tp, pp in ((1, 1), (2, 1), (4, 1), (1, 2)):
            if name == "gpt" and (tp, pp) not in ((1, 1), (2, 1)):  # one tensor-parallel case for GPT
                continue
            engine = Engine(EngineConfig(cache=CacheConfig(page_size=4, num_pages=128),
                                         scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
                                         parallel=ParallelConfig(tensor_parallel=tp, num_stages=pp), precompile=False,
                                         lora=LoRAConfig(max_loras=2, max_lora_rank=8)), loaded)
            engine.runner.load_lora(2, adapters[1])
            logits = prompt_logits(engine.runner, PROMPTS[1], lora_slot=2)
            loras = []
            for i, adapter in enumerate(adapters):
                lora = LoRARequest(adapter.name, i + 1, "(in memory)")
                engine.add_lora(lora, adapter)
                loras.append(lora)
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), request_id=str(i),
                                   lora_request=[None, *loras][i % 3])
            tokens = drain(engine)
            bucket = min(k.bucket for k in engine.runner.compilation.compiled_keys if isinstance(k, ForwardKey) and k.lora)
            engine.add_request([5], SamplingParams(max_tokens=1), request_id="plain")  # the bucket's plain program
            drain(engine)
            b_q = engine.runner.stages[0].lora.table[0]["attn"]["qkv"]["b_q"]  # [M, R, K, G, D]
            a_o = engine.runner.stages[0].lora.table[0]["attn"]["o"]["a"]  # [N, D, M, R]
            results[f"{name}/{tp}x{pp}"] = dict(
                logits=logits[:, :config.vocab_size].tolist(), tokens=[tokens[str(i)] for i in range(len(PROMPTS))],
                all_reduces=[all_reduces(engine.runner, bucket, lora) for lora in (False, True)],
                b_q_shard=list(b_q.addressable_shards[0].data.shape), a_o_shard=list(a_o.addressable_shards[0].data.shape))
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(4, "-c", SCRIPT)


@pytest.mark.parametrize("mesh", ["2x1", "4x1", "1x2"])
@pytest.mark.parametrize("model", ["llama-gqa", "gpt"])
def test_parallel_adapters_match_one_device(results, model, mesh):
    if f"{model}/{mesh}" not in results:
        pytest.skip("GPT runs one tensor-parallel case (the KV replication and pipelines are Llama's)")
    one, many = results[f"{model}/1x1"], results[f"{model}/{mesh}"]
    np.testing.assert_allclose(many["logits"], one["logits"], rtol=1e-5, atol=1e-5)
    assert many["tokens"] == one["tokens"]
    assert len({tuple(t) for t in one["tokens"][:3]}) == 3  # base and two adapters all differ


def test_adapter_term_adds_no_all_reduce(results):
    for key, facts in results.items():
        plain, with_lora = facts["all_reduces"]
        # The row-parallel A's [T, M, R] partial sums travel in the base's all-reduce (XLA combines them).
        assert with_lora == plain, key
        assert (plain > 0) == (not key.split("/")[1].startswith("1x")), key  # tensor parallel only


def test_table_is_split_like_the_base(results):
    # llama-gqa: 8 query heads in 2 KV groups of 4; tp=2 splits the groups, tp=4 replicates KV heads.
    assert results["llama-gqa/1x1"]["b_q_shard"] == [2, 8, 2, 4, 8]
    assert results["llama-gqa/2x1"]["b_q_shard"] == [2, 8, 1, 4, 8]
    assert results["llama-gqa/4x1"]["b_q_shard"] == [2, 8, 1, 2, 8]
    assert results["llama-gqa/2x1"]["a_o_shard"] == [4, 8, 2, 8]  # row-parallel: A split like o's input
