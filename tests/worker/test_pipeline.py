"""Pipeline stages x tensor parallelism over 8 fake CPU devices: one device's tokens for every mesh,
n_stages batches in flight, and each stage's program holding only its own layers.

One subprocess (tests/pipeline_cases.py) runs every case, so jax starts once with 8 devices.
"""

import json
import subprocess
import sys

import jax
import pytest

from orca_jax.config import ModelConfig, ModelFamily, ParallelConfig
from orca_jax.sharding.mesh import check_parallel_fits, make_stage_meshes, stage_layer_ranges

from tests.helpers.mesh import ROOT, fake_device_env, run_on_fake_devices
from tests.helpers.process import free_port

CASES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (2, 4)]  # (tensor parallel, stages), as in pipeline_cases
MODELS = ("llama", "gpt")
MODEL_VOCAB = {"llama": 255, "gpt": 257}  # odd, as pipeline_cases.MODELS has them


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices(8, "tests/helpers/pipeline_cases.py", timeout=900)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp,pp", CASES)
def test_greedy_tokens_match_one_device(results, model, tp, pp):
    one, case = results[f"{model}/1/1"], results[f"{model}/{tp}/{pp}"]
    assert len(one["tokens"]) == 8 and all(len(t) == 4 for t in one["tokens"].values())
    assert case["tokens"] == one["tokens"]
    assert case["pages_used"] == 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp,pp", CASES)
def test_engine_keeps_one_batch_per_stage_in_flight(results, model, tp, pp):
    case = results[f"{model}/{tp}/{pp}"]
    assert case["max_in_flight"] == pp
    # Only the pipeline's fill and drain run with fewer (8 requests, 2 per batch).
    assert case["mean_in_flight"] > pp - 0.5


def test_one_batch_in_flight_on_a_pipeline_gives_the_same_tokens(results):
    one = results["llama/2/2/one-in-flight"]
    assert one["max_in_flight"] == 1
    assert one["tokens"] == results["llama/2/2"]["tokens"]


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_async_scheduling_on_a_pipeline_gives_the_same_tokens(results, tp, pp):
    """Planning ahead on a pipeline: the tokens of one device, the stages still kept on disjoint batches
    while requests remain to fill them (one batch per stage, each of a share of the requests), and a
    request alone planned ahead of its token each iteration (two batches in flight, where without
    async scheduling a lone request keeps one)."""
    case, one = results[f"llama/{tp}/{pp}/async"], results["llama/1/1"]
    assert case["tokens"] == one["tokens"]
    assert case["max_in_flight"] == pp and case["mean_in_flight"] > pp - 0.5
    alone = results[f"llama/{tp}/{pp}/async-one"]
    assert alone["tokens"] == results["llama/1/1/async-one"]["tokens"]
    assert alone["max_in_flight"] == 2 and results["llama/1/2/sync-one"]["max_in_flight"] == 1
    assert alone["tokens"] == results["llama/1/2/sync-one"]["tokens"]


def test_prefix_caching_on_a_mesh_gives_one_devices_tokens(results):
    reference = results["llama/1/1/prefix-off"]
    off, on = results["llama/2/2/prefix-off"], results["llama/2/2/prefix-on"]
    assert on["tokens"] == off["tokens"] == reference["tokens"]
    assert on["hits"] >= 3 * 2 * 4 and off["hits"] == 0  # at least wave 2: two cached pages of 4 tokens each
    assert off["fed"] - on["fed"] == on["hits"]


def test_random_weights_made_by_stage_equal_the_whole_model(results):
    assert results["gpt/2/2/random-init"]["tokens"] == results["gpt/1/1/random-init"]["tokens"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp,pp", CASES)
def test_each_stage_holds_and_reads_only_its_own_layers(results, model, tp, pp):
    stages = results[f"{model}/{tp}/{pp}"]["stages"]
    assert len(stages) == pp
    per_stage = 4 // pp
    for s in range(pp):
        facts = stages[str(s)]
        devices = [list(range(s * tp, (s + 1) * tp))]
        assert facts["layers"] == [s * per_stage, (s + 1) * per_stage]
        assert facts["param_devices"] == devices and facts["kv_devices"] == devices
        assert facts["has_embed"] == (s == 0 or (s == pp - 1 and model == "gpt"))  # GPT ties its LM head
        assert facts["has_lm_head"] == (s == pp - 1 and model == "llama")
        # The program's per-device arguments are this stage's weight and KV shards, plus the control
        # data and at most a [T, H] = f32[8, 64] activation: no other stage's weights or pages.
        assert 0 < facts["argument_bytes"] - facts["own_bytes"] <= 8 * 64 * 4 + 512
        # Weights and KV are never gathered; with the vocabulary split, the last stage gathers its
        # f32[S, V] logits once (V padded to a multiple of tp).
        padded_vocab = -(-MODEL_VOCAB[model] // tp) * tp
        gathered = [g.split("{")[0] for g in facts["all_gathers"]]
        assert gathered == ([f"f32[2,{padded_vocab}]"] if tp > 1 and s == pp - 1 else [])


def test_stage_layout_and_refusals():
    assert stage_layer_ranges(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    config = ModelConfig(family=ModelFamily.LLAMA, vocab_size=64, hidden_size=32, num_layers=6, num_heads=4,
                         num_kv_heads=2, head_dim=8, ffn_size=64, max_seq_len=64)
    with pytest.raises(ValueError, match="num_stages=4 does not divide num_layers=6"):
        check_parallel_fits(ParallelConfig(num_stages=4), config)
    check_parallel_fits(ParallelConfig(num_stages=3, tensor_parallel=2), config)
    visible = len(jax.devices())
    with pytest.raises(ValueError, match=f"need {visible + 1} devices, {visible} are visible"):
        make_stage_meshes(ParallelConfig(num_stages=visible + 1))
    with pytest.raises(ValueError, match="coordinator_address"):
        ParallelConfig(num_processes=2)
    with pytest.raises(ValueError, match="process_id"):
        ParallelConfig(num_processes=2, process_id=2, coordinator_address="localhost:1234")



@pytest.mark.parametrize("devices_per_process,tp,pp", [(1, 2, 1), (2, 2, 2)])
def test_two_processes_joined_by_jax_distributed_give_one_device_tokens(results, tmp_path, devices_per_process,
                                                                         tp, pp):
    """Two processes on localhost form one mesh: tensor parallel 2 across them (as one process per GPU
    runs), or one 2-device stage on each (as one process per host runs, activations and tokens handed
    between processes by a collective). Process 0 schedules, process 1 mirrors every step. Each exits 0
    once both are done, however slowly the other gets there (jax's shutdown barrier waits for it)."""
    env = fake_device_env(devices_per_process)
    port = str(free_port())
    # Output to files, not pipes: a process blocked on a full pipe that nobody reads (this test waits
    # on the other first) would never reach the barrier its peer waits in.
    logs = [(open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")) for i in (1, 0)]
    procs = [subprocess.Popen([sys.executable, "tests/helpers/multihost_case.py", str(i), "2", port, str(tp), str(pp)],
                              cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
             for i, (out, err) in zip((1, 0), logs)]
    outs = []
    try:
        for proc, (out, err) in zip(procs, logs):
            proc.wait(timeout=600)
            out.seek(0)
            err.seek(0)
            assert proc.returncode == 0, err.read()[-3000:]
            outs.append(json.loads(out.read().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for files in logs:
            for f in files:
                f.close()
    worker, leader = outs
    assert leader["num_devices"] == 2 * devices_per_process and leader["processes"] == [0, 1]
    assert leader["tokens"] == results["llama/1/1"]["tokens"]
    assert leader["max_in_flight"] == pp
    assert worker["worker_iterations"] == leader["iterations"]
    assert worker["programs"] == leader["programs"]  # one bucket (T = 8): one forward per stage
    assert [p for p in leader["programs"] if p[0] == "ForwardKey"] == [["ForwardKey", [8, 2, 32], s, False, False, False, -1] for s in range(pp)]


def test_serve_flags_name_the_processes():
    from orca_jax.serve import build_parser, engine_config_from_args

    args = build_parser().parse_args(["--model", "tiny-llama", "--tensor-parallel-size", "2",
                                      "--pipeline-parallel-size", "2", "--coordinator-address", "10.0.0.1:12355",
                                      "--num-processes", "2", "--process-id", "1"])
    assert engine_config_from_args(args).parallel == ParallelConfig(
        num_stages=2, tensor_parallel=2, coordinator_address="10.0.0.1:12355", num_processes=2, process_id=1)
