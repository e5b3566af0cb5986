"""LoRA adapters over HTTP: a request's model picks the adapter and gets transformers + peft's tokens;
adapters are listed, loaded and unloaded while serving; bad ones get a 400 naming them and the server
keeps serving; `python -m orca_jax.serve --enable-lora --lora-modules ...` end to end."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import httpx
import numpy as np
import pytest

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.lora import LoRARequest
from orca_jax.models.loader import load_model
from orca_jax.server.app import create_app
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.engines import engine_with_loras
from tests.helpers.lora import MAX_RANK, write_adapters, write_base, write_llama_adapter
from tests.helpers.models import hf_greedy, hf_offline
from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port, wait_healthy
from tests.helpers.server import asgi_client

pytest.importorskip("torch")
pytest.importorskip("peft")
hf_offline()

KEY = {"Authorization": "Bearer sekrit"}
PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base directory, {adapter name: path}, {name or "base": expected greedy text})."""
    base_dir = str(tmp_path_factory.mktemp("llama"))
    base = write_base(base_dir, "llama")
    made = write_adapters(base, str(tmp_path_factory.mktemp("adapters")), "llama")
    tokenizer = load_model(base_dir).tokenizer
    expected = {name: tokenizer.decode(hf_greedy(model, PROMPT, MAX_TOKENS, ())) for name, (_, model) in made.items()}
    expected["base"] = tokenizer.decode(hf_greedy(base, PROMPT, MAX_TOKENS, ()))
    return base_dir, {name: path for name, (path, _) in made.items()}, expected


def completion(model: str | None = None, **extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **({} if model is None else {"model": model}), **extra}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_adapters_over_http(models, mode):
    base_dir, paths, expected = models
    build = functools.partial(engine_with_loras, EngineConfig(
        model=base_dir, cache=CacheConfig(page_size=8, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32), attention=AttentionBackend.JNP,
        precompile=False, lora=LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK)),
        (LoRARequest("all-r4", 1, paths["all-r4"]),))  # as --lora-modules does
    # In process mode the engine core (a child) serves the adapters; loads cross to it after their checks here.
    engine = build() if mode == "thread" else ProcessEngine(build)
    app = create_app(engine, api_key="sekrit", served_model_name="tiny")

    async def scenario():
        async with asgi_client(app, headers=KEY, timeout=120) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
                ("tiny", None, None), ("all-r4", "tiny", paths["all-r4"])]
            answer = (await client.post("/v1/completions", json=completion("all-r4", n=2))).json()
            assert [c["text"] for c in answer["choices"]] == [expected["all-r4"]] * 2
            assert answer["model"] == "all-r4"
            missing = await client.post("/v1/completions", json=completion("qv-r8"))
            assert missing.status_code == 404 and "'qv-r8' does not exist" in missing.json()["error"]["message"]
            # Loading, using and unloading while another adapter's long request streams on.
            long = asyncio.create_task(client.post("/v1/completions", json=completion("all-r4", max_tokens=40)))
            for name in ("qv-r8", "mlp-r2-rslora"):
                loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[name]})
                assert loaded.status_code == 200 and loaded.text == f"Success: LoRA adapter '{name}' added successfully."
            both = await asyncio.gather(*(client.post("/v1/completions", json=completion(name))
                                          for name in ("qv-r8", "mlp-r2-rslora", None)))
            assert [r.json()["choices"][0]["text"] for r in both] == [
                expected["qv-r8"], expected["mlp-r2-rslora"], expected["base"]]
            removed = await client.post("/v1/unload_lora_adapter", json={"lora_name": "all-r4"})
            assert removed.status_code == 200
            assert (await long).json()["choices"][0]["text"].startswith(expected["all-r4"])  # it kept its adapter
            assert (await client.post("/v1/completions", json=completion("all-r4"))).status_code == 404
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [
                "tiny", "qv-r8", "mlp-r2-rslora"]
            again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "all-r4"})
            assert again.status_code == 404 and again.json()["error"]["code"] == "lora_not_found"
            # Loading it back under its name gives it a new id; it still computes the same.
            await client.post("/v1/load_lora_adapter", json={"lora_name": "all-r4", "lora_path": paths["all-r4"]})
            answer = (await client.post("/v1/completions", json=completion("all-r4"))).json()
            assert answer["choices"][0]["text"] == expected["all-r4"]
            unauthorized = await client.post("/v1/load_lora_adapter", headers={"Authorization": "Bearer no"},
                                             json={"lora_name": "x", "lora_path": paths["qv-r8"]})
            assert unauthorized.status_code == 401
        if mode == "thread":
            assert engine.lora.num_loads >= 4  # two slots for four adapters over the test

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_bad_adapters_get_a_400_naming_them_and_serving_goes_on(models, tmp_path, mode):
    base_dir, paths, expected = models
    write_llama_adapter(tmp_path / "rank16", r=16)
    write_llama_adapter(tmp_path / "embed", targets=("q_proj", "embed_tokens"))
    write_llama_adapter(tmp_path / "shape", tensors={
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)})
    build = functools.partial(Engine, EngineConfig(
        model=base_dir, cache=CacheConfig(page_size=8, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), attention=AttentionBackend.JNP,
        precompile=False, lora=LoRAConfig(max_loras=1, max_lora_rank=MAX_RANK)))
    app = create_app(build() if mode == "thread" else ProcessEngine(build), served_model_name="tiny")
    cases = [("gone", str(tmp_path / "nothing-here"), "no such directory"),
             ("rank16", str(tmp_path / "rank16"), "rank 16 is above the server's maximum (8"),
             ("embed", str(tmp_path / "embed"), "target_modules names a module this llama model cannot adapt"),
             ("shape", str(tmp_path / "shape"), "does not fit the base model"),
             ("tiny", paths["qv-r8"], "already been loaded")]

    async def scenario():
        async with asgi_client(app, timeout=120) as client:
            for name, path, problem in cases:
                response = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                assert response.status_code == 400, (name, response.text)
                assert problem in response.json()["error"]["message"] and repr(name) in response.json()["error"]["message"]
            answer = await client.post("/v1/completions", json=completion())
            assert answer.json()["choices"][0]["text"] == expected["base"]
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["tiny"]

    asyncio.run(scenario())


@pytest.mark.slow  # two server processes (~25 s on a busy 2-core machine)
@pytest.mark.parametrize("engine_flag", ["--no-engine-process", "--engine-process"])
def test_serve_cli_with_lora_modules(models, tmp_path, engine_flag):
    base_dir, paths, expected = models
    port = free_port()
    common = [sys.executable, "-m", "orca_jax.serve", "--model", base_dir, "--port", str(port), "--page-size", "128",
              "--num-kv-pages", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--attention-backend", "jnp",
              "--log-level", "warning", "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_RANK),
              "--max-cpu-loras", "2", engine_flag]
    env = checkout_env()
    write_llama_adapter(tmp_path / "rank16", r=16)
    bad = subprocess.run(common + ["--lora-modules", f"big={tmp_path / 'rank16'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "LoRA adapter 'big': rank 16 is above the server's maximum" in bad.stderr
    modules = ["--lora-modules", f"all-r4={paths['all-r4']}", '{"name": "qv-r8", "path": "%s"}' % paths["qv-r8"]]
    process = OutputDrained(common + modules, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=300)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [base_dir, "all-r4", "qv-r8"]
        for name in ("all-r4", "qv-r8"):
            answer = httpx.post(url + "/v1/completions", json=completion(name), timeout=60).json()
            assert answer["choices"][0]["text"] == expected[name]
        metrics = httpx.get(url + "/metrics").text
        programs = next(line for line in metrics.splitlines() if line.startswith("orca_jax:num_compiled_programs"))
        # One bucket: its stage-in, its forward with and without adapters, the slot update, the eight
        # sampling programs and the penalty fill, all compiled at start-up: none while serving.
        assert float(programs.split()[-1]) == 4 + 8 + 1
    finally:
        process.terminate()
        process.communicate(timeout=60)
