"""`bench multiturn` end to end on a tiny model (CPU): prefix caching on computes fewer tokens than off
on the chat trace, the same on the no-sharing trace, and generates the same tokens."""

import json

import pytest

from orca_jax.bench import __main__ as bench

TINY = ["--model", "tiny-llama", "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--num-kv-pages", "256", "--page-size", "4", "--compilation-cache-dir", "none",
        "--num-conversations", "3", "--system-len", "18", "--turns", "3", "--user-len", "5", "--output-len", "4",
        "--num-prompts", "6", "--uniform-input-range", "8:40", "--uniform-output-range", "1:8"]


def _check(result):
    on, off = result["chat_caching_on"], result["chat_caching_off"]
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
    # Only what was not cached is computed (no preemption at this pool size).
    assert off["computed_tokens"] - on["computed_tokens"] == on["cached_tokens"] > 16 * 3
    assert [t["generated_tokens"] for t in on["turns"]] == [t["generated_tokens"] for t in off["turns"]]
    fresh = result["no-sharing_caching_on"]
    assert fresh["cached_tokens"] == 0 and fresh["computed_tokens"] == result["no-sharing_caching_off"]["computed_tokens"]
    assert result["orca_caching_on"][-1]["generated_tokens"] == result["orca_caching_off"][-1]["generated_tokens"]
    assert set(result["summary"]) >= {"chat_off_over_on", "no-sharing_off_over_on", "orca_on_over_off"}


def test_multiturn_in_process(tmp_path):
    bench.main(["multiturn", *TINY, "--result-dir", str(tmp_path)])
    _check(json.loads((tmp_path / "tiny-llama_multiturn.json").read_text()))
    assert bench.main(["report", str(tmp_path)]) is None


@pytest.mark.slow
def test_multiturn_over_http(tmp_path):
    bench.main(["multiturn", *TINY, "--sections", "chat", "--http", "--port", "8791", "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_multiturn.json").read_text())
    for label in ("on", "off"):
        turns = result[f"http_caching_{label}"]["turns"]
        assert len(turns) == 3 and all(t["errors"] == 0 for t in turns)


@pytest.mark.slow
def test_multiturn_on_two_replicas_keeps_each_chat_on_the_replica_holding_its_history(tmp_path):
    bench.main(["multiturn", *TINY, "--sections", "chat", "--data-parallel-size", "2", "--result-dir", str(tmp_path)])
    result = json.loads((tmp_path / "tiny-llama_multiturn.json").read_text())
    one, two = result["chat_caching_on"], result["chat_dp2"]
    assert two["prompt_tokens"] == one["prompt_tokens"]
    # After the first turn every chat finds its whole history where one engine would: the router sends a
    # chat's next turn to the replica holding its prefix. The first turn may compute the shared system
    # prompt once per replica.
    assert [t["cached_tokens"] for t in two["turns"][1:]] == [t["cached_tokens"] for t in one["turns"][1:]]
    assert two["turns"][0]["cached_tokens"] <= one["turns"][0]["cached_tokens"]
    assert 0.5 < result["summary"]["dp_hit_rate_over_one"] <= 1.0
