"""Tensor parallelism over fake CPU devices: the same tokens as one device, with the params split."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from orca_jax.config import ModelConfig, ModelFamily, ParallelConfig
from orca_jax.sharding.mesh import check_parallel_fits

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    from orca_jax.config import ParallelConfig
    from orca_jax.request import SamplingParams
    from engine_helpers import drain, tiny_engine
    results = {}
    for model in ("tiny-llama", "tiny-gpt"):
        for tp in (1, 2):
            engine = tiny_engine(model, parallel=ParallelConfig(tensor_parallel=tp))
            q = engine.runner.stages[0].params["layers"][0]["attn"]["q"]["kernel"]  # [H, N, D]
            shard_heads = {s.data.shape[1] for s in q.addressable_shards}
            cache_heads = {s.data.shape[0] for s in engine.runner.kv[-1].k.addressable_shards}
            for i, prompt in enumerate(([5, 6, 7], list(range(10, 40)), [99] * 9)):
                engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), request_id=str(i))
            results[f"{model}/{tp}"] = {"tokens": drain(engine), "q_heads_per_shard": sorted(shard_heads),
                                        "kv_heads_per_shard": sorted(cache_heads),
                                        "pages_used": engine.stats().kv_pages_used}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model,heads,kv_heads", [("tiny-llama", 4, 2), ("tiny-gpt", 4, 4)])
def test_tensor_parallel_matches_one_device(results, model, heads, kv_heads):
    one, two = results[f"{model}/1"], results[f"{model}/2"]
    assert two["q_heads_per_shard"] == [heads // 2] and two["kv_heads_per_shard"] == [kv_heads // 2]
    assert one["q_heads_per_shard"] == [heads]
    assert two["tokens"] == one["tokens"]
    assert two["pages_used"] == 0


def test_sizes_that_do_not_divide_are_refused():
    config = ModelConfig(family=ModelFamily.LLAMA, vocab_size=64, hidden_size=32, num_layers=2, num_heads=6,
                         num_kv_heads=3, head_dim=8, ffn_size=64, max_seq_len=64)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        check_parallel_fits(ParallelConfig(tensor_parallel=2), config)
    with pytest.raises(ValueError, match="num_layers=2"):
        check_parallel_fits(ParallelConfig(num_stages=3), config)
