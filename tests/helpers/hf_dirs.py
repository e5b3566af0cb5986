"""Tiny random Hugging Face Llama-family directories, written by transformers itself.

Each is what a user downloads: config.json, sharded *.safetensors with model.safetensors.index.json,
tokenizer.json and tokenizer_config.json (bos/eos and a chat template). Weights, biases and norm
scales are all randomised, so a wrong mapping of any of them shows up in the logits.
"""

from __future__ import annotations

import json
import os

VOCAB = 320  # the model's; the tokenizer uses fewer ids, as real checkpoints often do
SHARD_SIZE = "100KB"  # several files even for a 2-layer model

# Chat templates in the style of each family (Llama 2's uses bos_token and raise_exception).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n'"
    " + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3.1's shape: today's date from strftime_now (a fixed date where a renderer lacks it), tojson.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}"
    "{{- '<|im_start|>system\nToday Date: ' + date_string + '\nRoles: ' + (messages | map(attribute='role')"
    " | list | tojson) + '<|im_end|>' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}")

SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..3, in this order
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time there was a little robot.",
           "def f(x):\n    return x * 2\n", "What is the capital of France? Paris is."] * 4


def write_tokenizer(directory: str, chat_template: str, bos: str | None, eos: str) -> None:
    """A byte-level BPE (fits in VOCAB ids) plus tokenizer_config.json with the chat template; with a
    BOS, the post-processor adds it to every encoding, as real Llama and Mistral tokenizer.json do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS, trainer)
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                               special_tokens=[(bos, SPECIALS.index(bos))])
    backend.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
              "bos_token": bos, "eos_token": eos, "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


# kind -> (transformers classes, extra config, chat template, bos, eos)
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}, LLAMA2_TEMPLATE, "<s>", "</s>"),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "rope_theta": 10000.0,
        # With head_dim 16 and theta 1e4 the wavelengths span 6..20000 positions: original 64 with
        # factors 1 and 4 puts some in the kept band, some in the blended band, most in the stretched.
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        LLAMA3_TEMPLATE, "<s>", "<|im_end|>"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "rope_theta": 1000000.0},
              CHATML_TEMPLATE, None, "<|im_end|>"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None},
                MISTRAL_TEMPLATE, "<s>", "</s>"),
}


def write_hf_dir(directory: str, kind: str, seed: int = 0, torch_dtype=None):
    """Write a tiny random `kind` model (see KINDS) and its tokenizer; returns the transformers model."""
    import torch
    import transformers

    config_class, model_class, extra, template, bos, eos = KINDS[kind]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=None if bos is None else SPECIALS.index(bos), eos_token_id=SPECIALS.index(eos), **extra)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1: randomise so their mapping is tested
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    model.save_pretrained(directory, max_shard_size=SHARD_SIZE)
    write_tokenizer(directory, template, bos, eos)
    return model
