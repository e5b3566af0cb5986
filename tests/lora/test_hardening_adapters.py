"""Adapter directories from an attacker: every value checked finite and in range, every file bounded,
nothing read past what the model needs, and no message echoing what a file holds (a path may point
at any readable file). Each is a LoRAError (the server's 400) naming the file and the rule."""

from __future__ import annotations

import json
import os
import resource
import struct
import time

import numpy as np
import pytest

from orca_jax.lora.adapter import LoRAError, load_adapter
from orca_jax.models.presets import PRESETS

from tests.helpers.lora import write_llama_adapter

LLAMA = PRESETS["tiny-llama"]
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _load(path):
    return load_adapter(str(path), "bad", LLAMA, max_rank=8)


def _write_config(path, text: str) -> None:
    (path / "adapter_config.json").write_text(text)


@pytest.mark.parametrize("text, rule", [
    ('"r": NaN', r"adapter_config.json: NaN is not a JSON number"),
    ('"r": Infinity', r"adapter_config.json: Infinity is not a JSON number"),
    ('"r": 1e999', r"r must be an integer between 1 and 65536"),  # json reads 1e999 as inf
    ('"r": 2.5', r"r must be an integer between 1 and 65536"),
    ('"r": true', r"r must be an integer between 1 and 65536"),
    ('"lora_alpha": NaN', r"NaN is not a JSON number"),
    ('"lora_alpha": -Infinity', r"-Infinity is not a JSON number"),
    ('"lora_alpha": 1e300', r"lora_alpha must be a finite number above 0 and at most 65536"),
    ('"lora_alpha": 0', r"lora_alpha must be a finite number above 0"),
    ('"rank_pattern": ["q_proj"]', r"rank_pattern must be an object of at most 256 module patterns"),
    ('"rank_pattern": "q_proj"', r"rank_pattern must be an object"),
    ('"rank_pattern": {"(q_proj": 4}', r"rank_pattern's keys must be valid regular expressions"),
    ('"rank_pattern": {"(.*)*x": 4}', r"rank_pattern's keys may repeat at most 2 .* and no group"),
    ('"rank_pattern": {".*.*.*x": 4}', r"rank_pattern's keys may repeat at most 2"),
    ('"rank_pattern": {"q_proj": 1e999}', r"rank_pattern's values must be an integer"),
    ('"alpha_pattern": {"q_proj": -1}', r"alpha_pattern's values must be a finite number above 0"),
    ('"target_modules": 5', r"target_modules must be a string or a list of at most 1024 module names"),
    ('"target_modules": [5]', r"target_modules must be a string or a list"),
    ('"use_rslora": "yes"', r"use_rslora must be true or false"),
])
def test_config_values_out_of_range_are_refused_naming_the_file_and_rule(tmp_path, text, rule):
    write_llama_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    body = json.dumps({k: v for k, v in config.items() if k != text.split('"')[1]})
    _write_config(tmp_path, body[:-1] + ", " + text + "}")
    start = time.monotonic()
    with pytest.raises(LoRAError, match=rf"'bad': .*{rule}"):
        _load(tmp_path)
    assert time.monotonic() - start < 2


def test_a_config_nested_deep_or_too_large_is_refused(tmp_path):
    write_llama_adapter(tmp_path)
    _write_config(tmp_path, '{"r": 4, "lora_alpha": 8, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(LoRAError, match=r"adapter_config.json nests arrays and objects more than 64 levels deep"):
        _load(tmp_path)
    _write_config(tmp_path, '{"r": 4, "lora_alpha": 8, "x": "' + "a" * (2 << 20) + '"}')
    with pytest.raises(LoRAError, match=r"adapter_config.json: larger than 1048576 bytes"):
        _load(tmp_path)


def test_messages_never_echo_what_a_file_holds(tmp_path):
    """A config symlinked to another JSON file, weights symlinked to /proc/self/environ."""
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"r": "sk-SECRET-r", "lora_alpha": 8, "peft_type": "sk-SECRET-type"}))
    adapter = tmp_path / "a"
    write_llama_adapter(adapter)
    os.remove(adapter / "adapter_config.json")
    os.symlink(secret, adapter / "adapter_config.json")
    with pytest.raises(LoRAError) as refused:
        _load(adapter)
    assert "SECRET" not in str(refused.value) and "peft_type must be" in str(refused.value)
    secret.write_text(json.dumps({"r": "sk-SECRET-r", "lora_alpha": 8}))
    with pytest.raises(LoRAError) as refused:
        _load(adapter)
    assert "SECRET" not in str(refused.value) and "r must be an integer" in str(refused.value)

    write_llama_adapter(tmp_path / "b")
    os.remove(tmp_path / "b" / "adapter_model.safetensors")
    os.symlink("/proc/self/environ", tmp_path / "b" / "adapter_model.safetensors")
    os.environ["ORCA_TEST_SECRET"] = "sk-SECRET-env"
    with open("/proc/self/environ", "rb") as environ:
        environ_head = struct.unpack("<Q", environ.read(8).ljust(8, b"\0"))[0]
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: cannot read safetensors, truncated or corrupt") as refused:
        _load(tmp_path / "b")
    assert "SECRET" not in str(refused.value) and str(environ_head) not in str(refused.value)


def _write_weights(path, header: bytes | dict, data_bytes: int = 0, sparse_bytes: int = 0) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)
        if sparse_bytes:
            f.truncate(f.tell() + sparse_bytes)  # a hole: no disk, no page until read


@pytest.mark.parametrize("shape", [[2**62, 4], ["a"], [1.5], [-1], [4, 64, "x"]])
def test_safetensors_headers_with_impossible_shapes_are_refused(tmp_path, shape):
    write_llama_adapter(tmp_path)
    _write_weights(tmp_path, {Q_A: {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}, 16)
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: cannot read safetensors, truncated or corrupt"):
        _load(tmp_path)


def test_a_header_nested_deep_or_too_long_is_refused(tmp_path):
    write_llama_adapter(tmp_path)
    nested = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _write_weights(tmp_path, nested)
    with pytest.raises(LoRAError, match=r"cannot read safetensors, truncated or corrupt"):
        _load(tmp_path)
    _write_weights(tmp_path, b'{"__metadata__": {"a": "' + b"b" * (17 << 20) + b'"}}')
    with pytest.raises(LoRAError, match=r"a JSON header of at most 16777216 bytes"):
        _load(tmp_path)


def test_a_2gb_sparse_file_is_refused_without_being_read(tmp_path):
    """Shape [-1] over a 2 GB hole cost +4 GB of memory; a well-formed header whose tensor does not fit
    the model is refused from the header alone too."""
    write_llama_adapter(tmp_path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _write_weights(tmp_path, {Q_A: {"dtype": "F32", "shape": [-1], "data_offsets": [0, 2 << 30]}}, sparse_bytes=2 << 30)
    with pytest.raises(LoRAError, match=r"cannot read safetensors, truncated or corrupt"):
        _load(tmp_path)
    huge = {Q_A: {"dtype": "F32", "shape": [1 << 27, 4], "data_offsets": [0, 2 << 30]},
            Q_B: {"dtype": "F32", "shape": [64, 4], "data_offsets": [2 << 30, (2 << 30) + 1024]}}
    _write_weights(tmp_path, huge, sparse_bytes=(2 << 30) + 1024)
    start = time.monotonic()
    with pytest.raises(LoRAError, match=r"q_proj: lora_A does not fit the base model \(expected shape \(4, 64\)"):
        _load(tmp_path)
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: nothing read


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused(tmp_path, bad):
    tensors = write_llama_adapter(tmp_path)
    tensors[Q_B][3, 1] = bad
    from safetensors.numpy import save_file
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"q_proj: its weights \(lora_B times alpha / r\) must be finite"):
        _load(tmp_path)


def test_finite_weights_that_overflow_once_scaled_are_refused(tmp_path):
    tensors = write_llama_adapter(tmp_path, alpha=65536, r=1)
    tensors[Q_B][0, 0] = 3e38
    from safetensors.numpy import save_file
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=r"must be finite"):
        _load(tmp_path)
