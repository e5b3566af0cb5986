"""Adapters whose weights are finite but too large to serve (issue 47: lora_B of 1e19 or 7.5e37 gave
every request on them a 500 generation_failed): refused at load with a 400 naming the tensors, in
every serving dtype; a trained adapter's weights pass in every one."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from orca_jax.config import LoRAConfig
from orca_jax.lora.adapter import LoRAError, load_adapter
from orca_jax.models.presets import PRESETS
from orca_jax.server.app import create_app

from tests.helpers.engines import tiny_engine
from tests.helpers.lora import IN, OUT, write_llama_adapter
from tests.helpers.server import asgi_client

LLAMA = PRESETS["tiny-llama"]
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _adapter(path, b_value: float, a_value: float = 0.05, r: int = 4):
    tensors = {Q_A: np.full((r, IN["q_proj"]), a_value, np.float32), Q_B: np.full((OUT["q_proj"], r), b_value, np.float32)}
    write_llama_adapter(path, r=r, alpha=2 * r, targets=("q_proj",), layers=(0,), tensors=tensors)
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("b_value", [1e19, 7.5e37, 1e30])
def test_finite_weights_too_large_for_the_dtype_are_refused_naming_the_tensors(tmp_path, dtype, b_value):
    model = dataclasses.replace(LLAMA, dtype=dtype)
    with pytest.raises(LoRAError, match=r"lora_B\.weight") as refused:
        load_adapter(_adapter(tmp_path / "big", b_value), "big", model, max_rank=8)
    assert "q_proj" in str(refused.value) and dtype in str(refused.value)


def test_weights_beyond_float16_are_refused_in_float16_only(tmp_path):
    path = _adapter(tmp_path / "a", b_value=1e-3, a_value=7e4)  # lora_A alone past f16's 65504
    with pytest.raises(LoRAError, match=r"lora_A\.weight: holds 7e\+04.*float16"):
        load_adapter(path, "a", dataclasses.replace(LLAMA, dtype="float16"), max_rank=8)
    assert load_adapter(path, "a", LLAMA, max_rank=8).rank == 4  # float32 holds it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_trained_size_weights_pass_in_every_dtype(tmp_path, dtype):
    """peft's initialisation of A (Kaiming, ~1/sqrt(in)) and a trained B (~0.05), rank 64 and alpha 128."""
    rng = np.random.default_rng(0)
    r = 8
    tensors = {Q_A: rng.uniform(-1, 1, (r, IN["q_proj"])).astype(np.float32) / np.sqrt(IN["q_proj"]),
               Q_B: rng.normal(0, 0.05, (OUT["q_proj"], r)).astype(np.float32)}
    write_llama_adapter(tmp_path / "ok", r=r, alpha=16 * r, targets=("q_proj",), layers=(0,), tensors=tensors)
    assert load_adapter(str(tmp_path / "ok"), "ok", dataclasses.replace(LLAMA, dtype=dtype), max_rank=8).rank == r


@pytest.mark.slow  # a tiny engine's compiles (~30 s on a busy 2-core machine)
def test_loading_one_over_http_is_a_400_and_the_base_keeps_serving(tmp_path):
    engine = tiny_engine(lora=LoRAConfig(max_loras=2, max_lora_rank=8), compilation_cache_dir=None)
    app = create_app(engine, served_model_name="tiny")

    async def scenario():
        async with asgi_client(app) as client:
            for name, value in (("e19", 1e19), ("e37", 7.5e37)):
                answer = await client.post("/v1/load_lora_adapter",
                                           json={"lora_name": name, "lora_path": _adapter(tmp_path / name, value)})
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["code"] == "invalid_lora_adapter" and "q_proj.lora_B.weight" in error["message"]
            models = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["tiny"]
            greedy = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
            assert (await client.post("/v1/completions", json=greedy)).status_code == 200

    asyncio.run(scenario())
