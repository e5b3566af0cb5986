"""The issue's smaller items: kv_cache_usage_perc counted held pages twice; the client CLI with no
server named no URL and chat mode exited 0; every start logged jax's TPU probe."""

from __future__ import annotations

import asyncio
import logging

from orca_jax import client
from orca_jax.sampling_params import SamplingParams
from orca_jax.serve import no_tpu_runtime_line
from orca_jax.server.metrics import kv_cache_usage

from tests.helpers.engines import tiny_engine
from tests.helpers.process import free_port


def test_kv_cache_usage_of_one_request_is_its_reservation_over_the_pool():
    engine = tiny_engine(page_size=4, num_pages=64, compilation_cache_dir=None)
    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert stats.kv_pages_used > 0 and stats.kv_pages_reserved == 8  # (20 + 12) / 4, held ones included
    assert kv_cache_usage(stats) == 8 / stats.kv_pages_total  # was (used + reserved) / total: 1.42 seen
    while engine.has_unfinished():
        engine.step()
    assert kv_cache_usage(engine.stats()) == 0.0


def test_the_client_with_no_server_names_the_url_and_fails(tmp_path, monkeypatch, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    assert client.main(["--url", url, "batch", str(prompts), "--no-progress"]) == 1
    out = capsys.readouterr()
    assert f"cannot reach the server at {url}" in out.out + out.err
    monkeypatch.setattr("builtins.input", lambda prompt: "hi")
    assert client.main(["--url", url, "chat"]) == 1
    assert f"error: cannot reach the server at {url}" in capsys.readouterr().err


def test_a_chat_whose_turns_failed_exits_non_zero():
    class Failing:
        async def stream(self, path, body, on_text=None):
            raise client.ServerError("HTTP 500: boom")

    lines = iter(["hi", "/exit"])
    args = client.build_parser().parse_args(["chat"])
    written = []
    with asyncio.Runner() as runner:
        failures = client.run_chat(runner, Failing(), args, read_line=lambda _: next(lines), write=written.append)
    assert failures == 1 and "[error: HTTP 500: boom]" in "".join(written)


def test_only_the_tpu_probe_line_is_dropped():
    def record(message: str, *args) -> logging.LogRecord:
        return logging.LogRecord("jax._src.xla_bridge", logging.INFO, __file__, 1, message, args, None)

    probe = record("Unable to initialize backend '%s': %s", "tpu",
                   "INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open shared object file")
    assert not no_tpu_runtime_line(probe)
    assert no_tpu_runtime_line(record("Unable to initialize backend '%s': %s", "cuda", "no GPU"))
    assert no_tpu_runtime_line(record("Unable to initialize backend '%s': %s", "tpu", "TPU in use by pid 7"))
