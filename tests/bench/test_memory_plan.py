"""The memory plan's arithmetic on a model small enough to count by hand, and GPT-3 175B on 4 x 141 GiB."""

from orca_jax.bench.plan import GIB, memory_plan
import dataclasses

from orca_jax.config import ModelConfig, ModelFamily, Quantization
from orca_jax.models.presets import get_preset

# GPT, vocab 9 (padded to 10 at tp=2), hidden 4, 2 heads x 2 dims, ffn 8, 2 layers, 4 positions, bf16.
TINY = ModelConfig(family=ModelFamily.GPT, vocab_size=9, hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=2,
                   head_dim=2, ffn_size=8, max_seq_len=4, dtype="bfloat16")


def test_tiny_model_by_hand():
    plan = memory_plan(TINY, tensor_parallel=2, num_stages=2, gpu_bytes=10_000, xla_mem_fraction=0.5,
                       kv_fraction=0.85, page_size=4)
    # One layer per stage. Split over tp: q, k, v, o kernels 16 each, q/k/v biases 4 each, up 32 + bias 8,
    # down 32 = 148 params -> 74. Replicated: o bias 4, down bias 4, two norms' scale + bias 16 = 24.
    assert plan.layer_bytes == (74 + 24) * 2
    # Embedding 10 x 4 split -> 20, positions 4 x 4 = 16 and the final norm 8 replicated.
    assert plan.other_bytes == (20 + 16 + 8) * 2
    assert plan.weight_bytes == 284 and plan.padded_vocab_size == 10
    assert plan.kv_bytes_per_token == 2 * 1 * 1 * 2 * 2  # K and V x 1 layer x 1 head x 2 dims x 2 bytes
    assert plan.usable_bytes == 5000
    assert plan.kv_pool_bytes == int((5000 - 284) * 0.85) == 4008
    assert plan.headroom_bytes == 5000 - 284 - 4008
    assert (plan.max_kv_pages, plan.max_kv_tokens, plan.max_full_length_sequences) == (125, 500, 125)
    assert plan.fits


def test_an_fp8_untied_head_counts_its_e4m3_rows_and_scales():
    # Llama, vocab 9 (padded to 10 at tp=2), hidden 8, untied, bf16.
    llama = ModelConfig(family=ModelFamily.LLAMA, vocab_size=9, hidden_size=8, num_layers=2, num_heads=2,
                        num_kv_heads=2, head_dim=4, ffn_size=8, max_seq_len=4, dtype="bfloat16", tie_embeddings=False)
    fp8 = dataclasses.replace(llama, quantization=Quantization.FP8)
    kept = dataclasses.replace(fp8, quantize_lm_head=False)
    other = lambda config: memory_plan(config, tensor_parallel=2, num_stages=1, gpu_bytes=10_000).other_bytes
    # Embedding 10 x 8 bf16 split -> 80, final norm 8 bf16 -> 16; the head's shard: bf16 [8, 5] -> 80,
    # or e4m3 [5, 8] -> 40 and f32 scales [5] -> 20.
    assert other(llama) == other(kept) == 80 + 16 + 80
    assert other(fp8) == 80 + 16 + 40 + 20


def test_weights_past_the_usable_memory_do_not_fit():
    plan = memory_plan(TINY, tensor_parallel=2, num_stages=2, gpu_bytes=500, xla_mem_fraction=0.5)
    assert plan.kv_pool_bytes == 0 and plan.max_kv_tokens == 0 and not plan.fits


def test_gpt3_175b_fits_four_h200s_as_two_stages_of_two():
    config = get_preset("gpt3-175b")
    plan = memory_plan(config, tensor_parallel=2, num_stages=2, gpu_bytes=141 * GIB)
    # A quarter of 175B bf16 params plus the embedding shard each stage keeps.
    assert abs(plan.weight_bytes - config.num_params * 2 / 4) / plan.weight_bytes < 0.01
    assert plan.kv_bytes_per_token == 2 * 48 * 48 * 128 * 2  # 48 layers, 96 heads / 2, head dim 128
    assert plan.fits and plan.max_full_length_sequences >= 16
    one_gpu = memory_plan(config, 1, 1, 141 * GIB)
    assert not one_gpu.fits and one_gpu.max_kv_tokens == 0
