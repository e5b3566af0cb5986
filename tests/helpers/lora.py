"""Tiny base models and LoRA adapters made by peft itself (B drawn non-zero), saved as users save them;
and a tiny-llama adapter directory written by hand, as peft writes it (write_llama_adapter, no torch).

Each peft adapter differs in what it exercises: rank (padded up to the table's), scaling (alpha, rslora,
alpha_pattern), which projections it adapts (all seven, attention only, the MLP only).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
from safetensors.numpy import save_file

from tests.helpers.hf_dirs import write_hf_dir

# name -> peft LoraConfig arguments (Llama-family module names; GPT-2's are mapped below)
LLAMA_ADAPTERS = {
    "all-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
    "qv-r8": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "mlp-r2-rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "ko-r6-pattern": dict(r=6, lora_alpha=6, target_modules=["k_proj", "o_proj"], alpha_pattern={"o_proj": 12}),
}
GPT2_ADAPTERS = {
    "all-r4": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"]),
    "attn-r8": dict(r=8, lora_alpha=4, target_modules=["c_attn"]),
    "mlp-r2-rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["mlp.c_fc", "mlp.c_proj"]),
    "proj-r6": dict(r=6, lora_alpha=6, target_modules=["c_proj"]),
}
MAX_RANK = 8


def write_gpt2_dir(directory: str, seed: int = 0):
    """A tiny random GPT-2 (biases and norms randomised too), saved as safetensors; the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_base(directory: str, kind: str):
    """kind: a hf_dirs kind ("llama", "qwen2", ...) or "gpt2"; returns the transformers model."""
    return write_gpt2_dir(directory) if kind == "gpt2" else write_hf_dir(directory, kind)


def write_adapters(base, directory: str, kind: str, seed: int = 0) -> dict[str, tuple[str, object]]:
    """Every adapter of the kind's table under directory/<name>: name -> (path, peft model in eval mode)."""
    import peft
    import torch

    table = GPT2_ADAPTERS if kind == "gpt2" else LLAMA_ADAPTERS
    made = {}
    for i, (name, options) in enumerate(table.items()):
        torch.manual_seed(seed + i)
        # init_lora_weights=False: A and B both drawn (peft's default leaves B zero: no effect to test).
        config = peft.LoraConfig(init_lora_weights=False, fan_in_fan_out=kind == "gpt2", **options)
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
        with torch.no_grad():  # larger B: the adapters must move the logits well past float noise
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(4.0)
        path = os.path.join(directory, name)
        model.save_pretrained(path)
        made[name] = (path, model)
    return made


# A tiny-llama adapter written by hand (no peft): each projection's output and input sizes.
OUT = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 128, "up_proj": 128, "down_proj": 64}
IN = {"q_proj": 64, "k_proj": 64, "v_proj": 64, "o_proj": 64, "gate_proj": 64, "up_proj": 64, "down_proj": 128}


def write_llama_adapter(path, r=4, alpha=8, targets=("q_proj", "v_proj"), layers=(0, 1), config=None,
                        tensors=None, seed=0) -> dict[str, np.ndarray]:
    """A peft-style directory; returns the tensors written."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {}
        for i in layers:
            for t in targets:
                part = "self_attn" if t[0] in "qkvo" else "mlp"
                prefix = f"base_model.model.model.layers.{i}.{part}.{t}"
                tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, IN.get(t, 64)), np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((OUT.get(t, 64), r), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "use_dora": False, "use_rslora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}
    (path / "adapter_config.json").write_text(json.dumps(cfg | (config or {})))
    return tensors
