"""`bench serve`: its statistics by hand, and runs against our own live server (tiny model, CPU)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from orca_jax.bench import __main__ as bench_cli
from orca_jax.bench.datasets import LengthSpec, arrival_times, make_trace
from orca_jax.bench.datasets import DatasetName as TraceKind
from orca_jax.bench.serve_client import (Endpoint, PromptFormat, ServeBenchConfig, token_text, build_requests,
                                         run)
from orca_jax.bench.serve_stats import RequestRecord, Slo, summarize
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.server.app import create_app

from tests.helpers.server import live_server

SHORT = LengthSpec(prompt_range=(4, 24), gen_range=(2, 10))


def _record(index, sent, chunks, end, tokens):
    return RequestRecord(index, sent, 4, tokens, sent_s=sent, chunk_s=list(chunks), end_s=end,
                         output_tokens=tokens, usage_reported=True)


def test_summary_by_hand():
    records = [_record(0, 0.0, [0.1, 0.2, 0.3], 0.3, 3),  # TTFT 100 ms, TPOT 100 ms
               _record(1, 0.0, [0.5, 0.55], 0.55, 2),  # TTFT 500 ms, TPOT 50 ms
               RequestRecord(2, 0.0, 4, 3, error="HTTP 503: busy")]
    summary = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=200.0))
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (2, 1, 5)
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.5
    assert summary["ttft_ms"]["mean"] == pytest.approx(300.0) and summary["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(75.0)
    assert sorted(summary["itl_ms"][k] for k in ("min", "max")) == pytest.approx([50.0, 100.0])
    assert summary["itl_ms"]["count"] == 3
    assert summary["good_requests"] == 1 and summary["goodput"] == 0.5  # only the first meets TTFT 200 ms
    assert summary["errors"] == ["HTTP 503: busy"]


def test_arrivals_match_the_trace_module():
    trace = make_trace(TraceKind.UNIFORM, 50, 4.0, seed=7)
    np.testing.assert_allclose(arrival_times(50, 4.0, 7), [r.arrival for r in trace.requests])
    np.testing.assert_allclose(arrival_times(4, 2.0, 0, burstiness=float("inf")), [0.0, 0.5, 1.0, 1.5])
    assert not arrival_times(3, None, 0).any()
    assert Slo.parse(["ttft:100", "tpot:5", "e2el:900"]) == Slo(ttft_ms=100.0, tpot_ms=5.0, e2e_ms=900.0)
    with pytest.raises(ValueError, match="goodput"):
        Slo.parse(["itl:3"])


def test_requests_follow_the_trace():
    config = ServeBenchConfig("http://x", "m", num_requests=5, lengths=SHORT, vocab_size=100)
    trace = make_trace(TraceKind.UNIFORM, 5, None, 0, SHORT)
    requests = build_requests(config)
    assert [len(r.prompt) for r in requests] == [r.prompt_len for r in trace.requests]
    assert [r.max_tokens for r in requests] == [r.max_tokens for r in trace.requests]
    assert all(3 <= t < 100 for r in requests for t in r.prompt)
    with pytest.raises(ValueError, match="text prompts"):
        ServeBenchConfig("http://x", "m", endpoint=Endpoint.CHAT)


def test_token_chunks_are_told_apart_from_role_and_closing_chunks():
    chat = Endpoint.CHAT
    assert token_text({"choices": [{"delta": {"role": "assistant"}}]}, chat) is None
    assert token_text({"choices": [{"delta": {"content": "hi"}}]}, chat) == "hi"
    assert token_text({"choices": [{"delta": {}, "finish_reason": "length"}]}, chat) is None
    assert token_text({"choices": [], "usage": {"completion_tokens": 3}}, chat) is None
    assert token_text({"choices": [{"text": "", "finish_reason": None}]}, Endpoint.COMPLETIONS) == ""


@pytest.fixture(scope="module")
def server():
    engine = Engine(EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=16, num_pages=128),
                                 scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)))
    with live_server(create_app(engine, served_model_name="tiny")) as live:
        yield live


def _check_distributions(summary):
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms", "normalized_latency_ms"):
        dist = summary[key]
        assert dist["count"] > 0 and 0 < dist["min"] <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    assert summary["ttft_ms"]["max"] <= summary["e2e_latency_ms"]["max"]
    assert summary["normalized_latency_ms"]["max"] <= summary["e2e_latency_ms"]["max"]


def test_run_against_our_server(server):
    import asyncio

    config = ServeBenchConfig(server.url, "tiny", num_requests=8, request_rate=40.0, lengths=SHORT, ignore_eos=True,
                              slo=Slo(ttft_ms=60_000.0, tpot_ms=60_000.0))
    summary, records = asyncio.run(run(config, progress=False))
    assert (summary["completed"], summary["failed"]) == (8, 0), summary["errors"]
    assert summary["usage_reported"]
    # ignore_eos: every request generates exactly its max_tokens. Random byte ids are often pieces of
    # a UTF-8 character the server holds back, so a chunk may carry several tokens: usage counts them.
    assert [r.output_tokens for r in records] == [r.max_tokens for r in records]
    assert all(1 <= len(r.chunk_s) <= r.max_tokens for r in records)
    assert summary["total_output_tokens"] == sum(r.max_tokens for r in records)
    assert summary["total_prompt_tokens"] == sum(r.prompt_len for r in records)
    assert all(r.sent_s >= r.scheduled_s - 1e-3 for r in records)  # nobody sent early
    assert summary["good_requests"] == 8
    _check_distributions(summary)


def test_cli_chat_writes_json_and_the_report_plots_it(server, tmp_path, capsys):
    bench_cli.main(["serve", "--base-url", server.url, "--model", "tiny", "--endpoint", "chat",
                    "--num-prompts", "4", "--dataset-name", "homogeneous", "--random-input-len", "12",
                    "--random-output-len", "6", "--burstiness", "inf", "--ignore-eos", "--request-rate", "50",
                    "--goodput", "ttft:0.001", "--result-dir", str(tmp_path), "--disable-tqdm"])
    result = json.loads((tmp_path / "tiny_serve.json").read_text())
    summary = result["runs"][-1]
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 24
    # The engine's side of the run, from our server's /metrics: it generated what the client received.
    engine = summary["engine"]
    assert engine["generated_tokens"] == 24 and engine["iterations"] >= 6
    assert 1 <= engine["mean_batch_size"] <= 4 and engine["host_ms_per_iteration"] > 0
    assert engine["ms_per_iteration"] == pytest.approx(1e3 * summary["duration_s"] / engine["iterations"])
    assert summary["good_requests"] == 0  # nobody answers in a microsecond
    assert result["config"]["prompt_format"] == PromptFormat.TEXT.value and result["bench"] == "serve"
    assert len(result["requests"]) == 4 and all(r["ttft_s"] > 0 for r in result["requests"])
    _check_distributions(summary)
    assert "request throughput" in capsys.readouterr().out
    bench_cli.main(["report", str(tmp_path)])
    assert (tmp_path / "serve.png").stat().st_size > 1000 and "HTTP 1" in (tmp_path / "summary.md").read_text()


def test_jsonl_prompts_and_an_unreachable_server(tmp_path):
    import asyncio

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": "world"}\n')
    config = ServeBenchConfig("http://127.0.0.1:9", "m", dataset=None, dataset_path=str(path), custom_output_len=5,
                              timeout_s=5.0)
    assert [(r.prompt, r.max_tokens) for r in build_requests(config)] == [("hello", 3), ("world", 5)]
    unset = ServeBenchConfig("http://x", "m", dataset=None, dataset_path=str(path))
    assert [r.max_tokens for r in build_requests(unset)] == [3, None]  # the server's default then applies
    summary, records = asyncio.run(run(config, progress=False))
    assert summary["completed"] == 0 and summary["failed"] == 2 and all(r.error for r in records)
    assert summary["ttft_ms"] == {"count": 0} and not math.isnan(summary["request_throughput"])
