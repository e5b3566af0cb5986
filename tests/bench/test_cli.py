"""Every `python -m orca_jax.bench` subcommand end to end on a tiny model on CPU: the GPU runs are what the
numbers are for; here each entry point must run, write its stamped JSON, and its numbers must agree with
an independent count (the dataset's tokens, a host replay of the schedule, the model's parameter count)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from orca_jax.bench import __main__ as bench
from orca_jax.bench import harness
from orca_jax.bench.datasets import LengthSpec, make_trace
from orca_jax.bench.harness import engine_argv, engine_config, serve_flags
from orca_jax.bench.plan import GIB, memory_plan
from orca_jax.bench.sweep import compare_at_matched_latency, throughput_at_latency
from orca_jax.models.presets import get_preset
from orca_jax.sample.sampler import sample_variants

from tests.helpers.mesh import ROOT, fake_device_env
from tests.helpers.process import checkout_env

ENGINE = ["--model", "tiny-llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--num-kv-pages", "128"]
SHORT = ["--uniform-input-range", "8:96", "--uniform-output-range", "1:12"]
SHORT_LENGTHS = LengthSpec(prompt_range=(8, 96), gen_range=(1, 12))
STAMP = ("bench", "model", "device", "platform", "jax", "commit", "source_digest", "command", "args")


def _result(directory, name: str) -> dict:
    result = json.loads((directory / name).read_text())
    assert all(key in result for key in STAMP), set(STAMP) - set(result)
    return result


def _bench_in_child(argv: list[str], env=None, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "orca_jax.bench", *argv], cwd=ROOT, capture_output=True, text=True,
                          env=env or checkout_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in bench.SUBCOMMANDS)


def test_help_lists_the_presets_and_each_flags_default(capsys):
    with pytest.raises(SystemExit):
        bench.main(["throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "tiny-llama" in text and "smollm2-135m" in text
    assert "(default: 512)" in text and "(default: uniform)" in text  # --num-prompts, --dataset-name
    assert "64 on a CPU" in text and "of the bound" in text


def test_the_default_dataset_is_fitted_to_the_context_before_anything_compiles(tmp_path, capsys):
    """The default uniform trace (prompts to 512, outputs to 128) on tiny-llama's 512-token context: prompts
    are shortened, with one line naming the flags, and every request runs (it once failed after compiling)."""
    bench.main(["throughput", *ENGINE, "--num-prompts", "8", "--num-runs", "1", "--result-dir", str(tmp_path)])
    notes = [line for line in capsys.readouterr().err.splitlines() if "tiny-llama's context" in line]
    assert notes == ["bench: tiny-llama's context is 512 tokens (--max-model-len): --uniform-input-range 32:512 "
                     "--uniform-output-range 1:128 shortened to 32:384 and 1:128"]
    (row,) = _result(tmp_path, "tiny-llama_throughput.json")["runs"]
    assert row["dataset"]["prompt_len"]["max"] + row["dataset"]["max_tokens"]["max"] <= 512
    assert row["runs"][0]["generated_tokens"] == make_trace("uniform", 8, None, 0, LengthSpec().fit(512)[0]
                                                            ).num_generated_tokens


def test_latencys_one_shape_is_fitted_to_the_context(capsys):
    args = bench.build_parser().parse_args(["latency", "--model", "tiny-llama", "--input-len", "600"])
    harness.fit_to_context(args)
    assert (args.input_len, args.output_len) == (480, 32)
    assert "--input-len 600 --output-len 32 shortened to 480 and 32" in capsys.readouterr().err


@pytest.mark.slow
def test_throughput_with_its_default_flags_runs_on_tiny_llama(tmp_path):
    """`bench throughput --model tiny-llama` as the README gives it: the default dataset (512 requests),
    the CPU's default batch shape, two runs; 4-8 minutes on 2 busy cores, compiling included."""
    proc = _bench_in_child(["throughput", "--model", "tiny-llama", "--result-dir", str(tmp_path)],
                           env=checkout_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache")))
    assert "of the bound:" in proc.stdout
    result = _result(tmp_path, "tiny-llama_throughput.json")
    assert result["engine"]["max_num_batched_tokens"] == 512
    (row,) = result["runs"]
    assert row["max_num_seqs"] == 64 and len(row["runs"]) == 2
    trace = make_trace("uniform", 512, None, 0, LengthSpec().fit(512)[0])
    assert row["runs"][-1]["generated_tokens"] == trace.num_generated_tokens


@pytest.mark.parametrize("weights", [[], ["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--no-quantize-lm-head",
                                          "--no-dispatch-thread"]],
                         ids=["default", "fp8-head-kept-inline"])
def test_the_served_engine_and_a_child_engine_are_the_in_process_engine(weights):
    from orca_jax import serve

    args = bench.build_parser().parse_args(["throughput", *ENGINE, "--max-num-seqs", "4,16", "--async-scheduling", "off",
                                            "--kv-allocation", "on_demand", "--dtype", "float32", *weights])
    served = serve.engine_config_from_args(serve.build_parser().parse_args(serve_flags(args, 8000)))
    assert served == engine_config(args) and served.scheduler.max_num_seqs == 16
    child = bench.build_parser().parse_args(["startup", *engine_argv(args)])
    assert engine_config(child) == engine_config(args)
    assert (engine_config(args).quantization is None) == (not weights)
    assert engine_config(args).quantize_lm_head == (not weights)  # on unless --no-quantize-lm-head
    assert engine_config(args).dispatch_thread == (not weights)  # on unless --no-dispatch-thread


def test_bench_serve_launches_serve_s_own_engine_and_compares_with_that_engine():
    """Engine flags not given are serve's own choice for the model and device, in the launched server and
    in the in-process comparison alike; flags given override them in both."""
    from orca_jax import serve
    from orca_jax.bench.serve import resolve_server_defaults
    from orca_jax.engine.defaults import UsageContext, batch_defaults

    def served_config(args):
        served_args = serve.build_parser().parse_args(serve_flags(args, 8000))
        return serve.engine_config_from_args(
            served_args, batch_defaults(UsageContext.SERVER, get_preset("tiny-llama").num_params))

    bare = bench.build_parser().parse_args(["serve", "--model", "tiny-llama", "--num-kv-pages", "128", "--launch"])
    flags = serve_flags(bare, 8000)
    assert not {"--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy", "--kv-allocation",
                "--no-priority-preemption", "--long-prefill-token-threshold"} & set(flags)
    assert served_config(bare) == engine_config(resolve_server_defaults(bare))
    assert engine_config(resolve_server_defaults(bare)).scheduler.policy.value == "priority"
    given = bench.build_parser().parse_args(["serve", "--model", "tiny-llama", "--max-num-seqs", "8",
                                             "--scheduling-policy", "fcfs", "--kv-allocation", "reserve"])
    resolved = engine_config(resolve_server_defaults(given))
    assert served_config(given) == resolved
    assert (resolved.scheduler.max_num_seqs, resolved.scheduler.policy.value) == (8, "fcfs")


def test_throughput_interleaved_over_budgets(tmp_path):
    """--interleave: both budgets' engines alive, every point run once per round; medians reported."""
    argv = ["throughput", *ENGINE[:4], "--max-num-batched-tokens", "16,32", "--kv-cache-memory-gib", "0.01", *SHORT,
            "--num-prompts", "6", "--num-runs", "3", "--interleave", "--result-dir", str(tmp_path)]
    bench.main(argv)
    result = _result(tmp_path, "tiny-llama_throughput.json")
    assert [e["max_num_batched_tokens"] for e in result["engines"]] == [16, 32]
    trace = make_trace("uniform", 6, None, 0, SHORT_LENGTHS)
    for row in result["runs"]:
        assert len(row["runs"]) == 3 and all(r["generated_tokens"] == trace.num_generated_tokens for r in row["runs"])
        assert row["median_tokens_per_s"] == sorted(r["tokens_per_s"] for r in row["runs"])[1]
    with pytest.raises(SystemExit, match="kv-cache-memory-gib"):
        bench.main([a for a in argv if a not in ("--kv-cache-memory-gib", "0.01")])


def test_throughput_orca_and_request_level_on_the_paper_trace_and_tcb(tmp_path):
    bench.main(["throughput", *ENGINE, *SHORT, "--num-prompts", "12", "--dataset-name", "uniform,tcb",
                "--tcb-load", "2", "--scheduler", "orca,request-level", "--async-scheduling", "on,off",
                "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "tiny-llama_throughput.json")
    assert result["bench"] == "throughput" and result["engine"]["num_compiled_programs"] > 0
    rows = {(r["dataset"]["kind"], r["scheduler"], r["async_scheduling"]): r for r in result["runs"]}
    assert set(rows) == {(kind, "orca", True) for kind in ("uniform", "tcb")} | {
        (kind, "orca", False) for kind in ("uniform", "tcb")} | {(kind, "request-level", False) for kind in ("uniform", "tcb")}
    trace = make_trace("uniform", 12, None, 0, SHORT_LENGTHS)
    for (kind, scheduler, overlap), row in rows.items():
        first, last = row["runs"]
        if kind == "tcb":
            assert row["dataset"]["time_unit"] == "iteration" and "tokens_per_iteration" in last
            assert 0 < last["utility"] <= last["max_utility"] and 0 < last["hit_rate"] <= 1
            continue
        # EOS ignored: every request generates its max_tokens, in both runs.
        assert first["generated_tokens"] == last["generated_tokens"] == trace.num_generated_tokens
        assert 0 < row["fraction_of_bound"] < 1 and row["bound_tokens_per_s"] > last["tokens_per_s"] > 0
        split = last["host_split"]
        assert all(split[k] > 0 for k in ("schedule_s", "build_s", "dispatch_s", "update_s"))
        assert split["rest_s"] >= -1e-3, split
        if not overlap:  # one batch in flight: the host replay is the engine's own schedule
            assert row["iterations"] == last["iterations"]
            assert row["fed_over_real"] == pytest.approx(last["fed_over_real"])
    # A finished request leaves ORCA's batch at once, the baseline's only with its whole batch.
    assert rows["uniform", "orca", False]["runs"][-1]["iterations"] < \
        rows["uniform", "request-level", False]["runs"][-1]["iterations"]
    report = bench.main(["report", str(tmp_path)])
    assert report is None and "| tcb variance=20.0 load=2.0" in (tmp_path / "summary.md").read_text()


def test_latency_against_the_weight_read_bound(tmp_path):
    bench.main(["latency", *ENGINE, "--dtype", "float32", "--batch-size", "1,4", "--input-len", "24",
                "--output-len", "6", "--num-iters", "2", "--decode-steps", "5", "--decode-repeats", "2",
                "--async-scheduling", "on,off", "--no-fuse-decode-sampling", "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "tiny-llama_latency.json")
    assert result["args"]["fuse_decode_sampling"] is False
    engine = result["engine"]
    config = get_preset("tiny-llama")  # fp32; num_params leaves out the norms' scales
    assert engine["params_bytes"] == 4 * (config.num_params + (2 * config.num_layers + 1) * config.hidden_size)
    assert engine["weight_bound_ms"] == pytest.approx(1e3 * engine["params_bytes"] / (engine["peaks"]["hbm_GB_s"] * 1e9))
    assert [(r["async_scheduling"], r["batch_size"]) for r in result["rows"]] == [(True, 1), (True, 4), (False, 1), (False, 4)]
    for row in result["rows"]:
        assert row["decode_iterations"] == 10 and row["ms_per_iteration"] > 0  # two windows of 5 steps
        low, median, high = row["ms_per_iteration_quartiles"]
        assert low <= median <= high and median == pytest.approx(row["ms_per_iteration"])
        assert len(row["ms_per_iteration_windows"]) == 2 and min(row["ms_per_iteration_windows"]) <= high
        assert row["fraction_of_bound"] == pytest.approx(row["weight_bound_ms"] / row["ms_per_iteration"])
        assert 1e3 * row["batch_latency_s"] > row["ms_per_iteration"] and row["device_busy_ms"] > 0


def test_sweep_by_hand_and_end_to_end(tmp_path):
    point = lambda scheduler, cap, rate, done, latency: {"scheduler": scheduler, "max_num_seqs": cap, "rate": rate,
                                                          "requests_per_s": done, "median_norm_latency_s": latency}
    orca = [point("orca", 8, 1, 1.0, 0.01), point("orca", 8, 2, 2.0, 0.03)]
    assert throughput_at_latency(orca, 0.02) == pytest.approx(1.5)  # halfway between the two points
    assert throughput_at_latency(orca, 0.005) == 0.0
    base = [point("request-level", 4, 1, 0.5, 0.015), point("request-level", 8, 1, 0.8, 0.05)]
    (row,) = compare_at_matched_latency(orca + base, multiples=(2.0,))
    assert row["orca"]["requests_per_s"] == pytest.approx(1.5) and row["request-level"]["max_num_seqs"] == 4
    assert row["ratio"] == pytest.approx(3.0)
    bench.main(["sweep", *ENGINE, *SHORT, "--max-num-seqs", "4,8", "--request-rate", "20,80", "--min-point-prompts", "6",
                "--max-point-prompts", "8", "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "tiny-llama_sweep.json")
    assert {(p["scheduler"], p["max_num_seqs"]) for p in result["points"]} == {
        (s, c) for s in ("orca", "request-level") for c in (4, 8)}
    assert all(p["num_requests"] == 8 and p["median_norm_latency_s"] > 0 for p in result["points"] if "error" not in p)
    assert result["matched_latency"] == json.loads(json.dumps(compare_at_matched_latency(result["points"])))


def test_plan_matches_the_memory_plan_and_ragged_batching_pads_least(tmp_path):
    bench.main(["plan", "--model", "gpt3-175b", "-tp", "2", "-pp", "2", "--gpu-memory-gib", "141", "--num-prompts", "64",
                "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "gpt3-175b_plan.json")
    plan = memory_plan(get_preset("gpt3-175b"), 2, 2, 141 * GIB)
    assert result["memory_plan"]["max_kv_tokens"] == plan.max_kv_tokens and result["memory_plan"]["fits"]
    for row in result["padding"]["rows"]:
        assert row["ragged_bucket_waste"] < row["sorted_waste"] <= row["naive_waste"]


@pytest.mark.slow
def test_kernel_interpreted_checks_and_times_every_section(tmp_path):
    bench.main(["kernel", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--contexts", "32",
                "--batch-sizes", "1,2", "--prefill-len", "16", "--prefill-batch", "2", "--check", "timed-shape",
                "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "attention-h4-kv2-d16_kernel.json")
    (check,) = result["check"]
    assert check["ok"] and check["max_abs_err"] <= check["tolerance"]
    assert [(r["context"], r["batch_size"]) for r in result["decode"]] == [(32, 1), (32, 2)]
    assert all(r["frac_of_copy"] == pytest.approx(r["kv_gb_s"] / result["copy"]["copy_gb_s"]) for r in result["decode"])
    assert result["prefill"]["tflops"] > 0 and result["prefill"]["dense_us"] > 0


@pytest.mark.parametrize("device", sorted(os.listdir(os.path.join(ROOT, "benchmarks", "results"))))
def test_report_reads_every_committed_results_dir(device, tmp_path):
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results", device), tmp_path / device)
    bench.main(["report", str(tmp_path / device), "--no-plots"])
    summary = (tmp_path / device / "summary.md").read_text()
    names = [n for n in os.listdir(tmp_path / device) if n.endswith(".json")]
    assert names and all(f"({name})" in summary for name in names) and "Not results" not in summary
    if device == "h100":  # docs/benchmarks.md's figures
        assert "| llama-8b | NVIDIA H100 80GB HBM3 | 5,594 | 0.664 | 605 | 9.24 | 0.915 | 5.96 | 5.52 |" in summary


@pytest.mark.slow
@pytest.mark.parametrize("engine_flag", ["--no-engine-process", "--engine-process", "--api-server-count=2"])
def test_serve_launches_our_server_and_compares_with_in_process(tmp_path, engine_flag):
    # In a child process: the engine's compilation cache is a process-wide jax setting.
    _bench_in_child(["serve", *ENGINE, "--dtype", "float32", *SHORT, "--num-prompts", "8", "--launch", "--port", "8791",
                     "--compare-in-process", "--num-runs", "2", "--ignore-eos", "--disable-tqdm", engine_flag,
                     "--compilation-cache-dir", str(tmp_path / "cache"), "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "tiny-llama_serve.json")
    generated = make_trace("uniform", 8, None, 0, SHORT_LENGTHS).num_generated_tokens
    assert [r["completed"] for r in result["runs"]] == [8, 8]
    assert all(r["total_output_tokens"] == generated for r in result["runs"])  # EOS ignored: every token asked for
    assert [r["generated_tokens"] for r in result["in_process"]] == [generated, generated]
    assert result["server"]["programs_after"] == result["server"]["programs_at_ready"] > 0  # nothing compiled late
    assert result["http_over_in_process"] == pytest.approx(
        result["runs"][-1]["output_throughput"] / result["in_process"][-1]["tokens_per_s"])


@pytest.mark.slow
def test_startup_cold_then_warm_from_the_executable_cache(tmp_path):
    small = ["--model", "tiny-llama", "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--num-kv-pages", "64"]
    bench.main(["startup", *small, "--result-dir", str(tmp_path)])
    cold, warm = _result(tmp_path, "tiny-llama_startup.json")["runs"]
    # Buckets 8 and 16: a forward and a stage-in each; at S = 8 the sampling family (plain greedy or not with
    # 0 or 20 top logprobs, and each mode with logits processing: 8) and the penalty tables' fill.
    programs = 2 * 2 + len(sample_variants(20)) + 1
    assert cold["num_programs"] == warm["num_programs"] == programs == 13
    assert cold["executable_cache"] == {"hits": 0, "misses": programs}
    assert warm["executable_cache"] == {"hits": programs, "misses": 0}
    assert warm["compile_s"] < cold["compile_s"]


def test_peer_runs_transformers_on_the_same_trace(tmp_path):
    bench.main(["peer", "--model", "tiny-llama", "--device", "cpu", "--num-prompts", "6", *SHORT, "--batch-size", "2",
                "--input-len", "8", "--output-len", "4", "--result-dir", str(tmp_path)])
    result = _result(tmp_path, "tiny-llama_peer.json")
    trace = make_trace("uniform", 6, None, 0, SHORT_LENGTHS)
    assert result["offline"]["generated_tokens"] == trace.num_generated_tokens
    assert result["offline"]["requests_with_wrong_length"] == 0
    assert result["latency"][0]["generated_tokens"] == 2 * 4


@pytest.mark.slow
def test_throughput_and_latency_on_a_tensor_and_pipeline_mesh(tmp_path):
    mesh = [*ENGINE, "-tp", "2", "-pp", "2", "--dtype", "float32"]
    env = fake_device_env(4)
    _bench_in_child(["throughput", *mesh, *SHORT, "--num-prompts", "8", "--max-in-flight", "2,1", "--num-runs", "1",
                     "--compilation-cache-dir", str(tmp_path / "cache"), "--result-dir", str(tmp_path)], env)
    _bench_in_child(["latency", *mesh, "--batch-size", "2", "--input-len", "16", "--output-len", "4", "--num-iters", "1",
                     "--compilation-cache-dir", str(tmp_path / "cache"), "--result-dir", str(tmp_path)], env)
    throughput = _result(tmp_path, "tiny-llama_throughput.json")
    assert throughput["num_devices"] == 4 and throughput["engine"]["num_devices"] == 4
    two, one = ({r["max_in_flight"]: r for r in throughput["runs"]}[k]["runs"][-1] for k in (2, 1))
    assert two["generated_tokens"] == one["generated_tokens"] > 0
    assert one["mean_in_flight"] == 1 and 1 < two["mean_in_flight"] <= 2  # pipelined: two batches in flight
    (row,) = _result(tmp_path, "tiny-llama_latency.json")["rows"]
    assert row["ms_per_iteration"] > 0 and row["weight_bound_ms"] > 0


def test_results_name_the_commit_given_for_a_copied_tree(monkeypatch):
    # A tree copied to another machine keeps a stale .git there: the caller names the commit instead.
    monkeypatch.delenv("ORCA_JAX_COMMIT", raising=False)
    own = harness.source_commit()
    assert own == "unknown" or len(own.split("-")[0]) == 12
    monkeypatch.setenv("ORCA_JAX_COMMIT", "0123456789ab")
    assert harness.source_commit() == "0123456789ab"
