"""The engine with LoRA adapters (tiny-llama, random adapters; no torch): the programs it compiles and
that loading an adapter compiles nothing, the table updated in place, batches without adapters on the
plain program, preemption and the offline LLM entry point."""

from __future__ import annotations

import random

import jax
import numpy as np

from orca_jax.config import KVAllocation, LoRAConfig
from orca_jax.lora import LoRARequest
from orca_jax.lora.adapter import random_adapter
from orca_jax.lora.ops import LoRATokens, dense_delta, gather_delta, ragged_dot_delta, reference_delta
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import ForwardKey, LoRAUpdateKey

from tests.helpers.engines import drain, tiny_engine


def lora_engine(max_loras=2, **overrides):
    return tiny_engine(lora=LoRAConfig(max_loras=max_loras, max_lora_rank=8), **overrides)


def add_random_adapters(engine, count: int, rank: int = 4) -> list[LoRARequest]:
    loras = []
    for i in range(count):
        lora = LoRARequest(f"random-{i}", i + 1, "(in memory)")
        engine.add_lora(lora, random_adapter(engine.model_config, rank, seed=i, name=lora.lora_name, b_std=0.3))
        loras.append(lora)
    return loras


def test_program_count_and_loading_an_adapter_compiles_nothing():
    """With LoRA every bucket has a second forward (with the adapter term) and each stage one
    slot-update program: buckets 8, 16, 32 -> 3 stage-in + 6 forward + 1 update + 17 sampling (the
    family of 8 per S, S 8 or 16, and the penalty-table fill; sample/sampler.py) = 27. Then adapters are
    loaded, swapped and mixed with base requests, and nothing more compiles."""
    engine = lora_engine(max_num_seqs=16, max_num_batched_tokens=32, num_pages=400, precompile=True)
    compilation = engine.runner.compilation
    assert compilation.num_compiled_programs == 3 + 6 + 1 + 2 * 8 + 1
    assert sum(isinstance(k, ForwardKey) and k.lora for k in compilation.compiled_keys) == 3
    assert LoRAUpdateKey(0) in compilation.compiled_keys
    loras = add_random_adapters(engine, 3)
    rng = random.Random(0)
    for i in range(24):
        engine.add_request([rng.randrange(3, 250) for _ in range(rng.randint(1, 30))],
                           SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True, temperature=rng.choice([0, 0.7]),
                                          logprobs=rng.choice([None, 2])),
                           lora_request=rng.choice([None, *loras]))
    drain(engine)
    assert engine.lora.num_loads >= 3  # three adapters through two slots
    assert compilation.num_compiled_programs == 27


def test_a_batch_without_adapters_runs_the_plain_program():
    engine = lora_engine()
    (lora,) = add_random_adapters(engine, 1)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    drain(engine)
    assert not any(isinstance(k, ForwardKey) and k.lora for k in engine.runner.compilation.compiled_keys)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), lora_request=lora)
    drain(engine)
    assert any(isinstance(k, ForwardKey) and k.lora for k in engine.runner.compilation.compiled_keys)


def test_the_table_is_updated_in_place_and_holds_the_adapter():
    engine = lora_engine()
    (lora,) = add_random_adapters(engine, 1, rank=3)
    table = engine.runner.stages[0].lora.table
    address = table[0]["attn"]["qkv"]["a"].unsafe_buffer_pointer()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), lora_request=lora)
    drain(engine)
    table = engine.runner.stages[0].lora.table
    assert table[0]["attn"]["qkv"]["a"].unsafe_buffer_pointer() == address  # donated, written in place
    slot = engine.lora.slots.slot_of(lora.lora_int_id)
    adapter = random_adapter(engine.model_config, 3, seed=0, b_std=0.3)
    down_b = np.asarray(table[1]["mlp"]["down"]["b"])  # [M, R, H]
    np.testing.assert_array_equal(down_b[slot - 1, :3], adapter.layers[1]["down"][1])
    assert not down_b[slot - 1, 3:].any() and not down_b[2 - slot].any()  # rank padding; the other slot


def test_adapters_mixed_with_preemption_give_each_request_its_tokens_alone():
    """ON_DEMAND KV too small for all: requests are preempted (their slots released and taken again)
    and recomputed; every request's greedy tokens equal those of its run alone."""
    engine = lora_engine(max_loras=2, num_pages=12, page_size=4, max_num_seqs=6,
                         scheduler_options={"kv_allocation": KVAllocation.ON_DEMAND})
    loras = add_random_adapters(engine, 3)
    rng = random.Random(1)
    jobs = [([rng.randrange(3, 250) for _ in range(rng.randint(2, 9))], loras[i % 3] if i % 4 else None)
            for i in range(8)]

    def run(batch):
        ids = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True), lora_request=lora)
               for p, lora in batch]
        done = drain(engine)
        return [done[i] for i in ids]

    alone = [run([job])[0] for job in jobs]
    preemptions = engine.stats().num_preemptions
    assert run(jobs) == alone
    assert engine.stats().num_preemptions > preemptions
    assert len({tuple(t) for t in alone}) == len(alone)


def test_offline_llm_with_lora_requests():
    from orca_jax import LLM

    llm = LLM("tiny-llama", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_pages=64, page_size=4,
              max_num_seqs=4, max_num_batched_tokens=32)
    loras = add_random_adapters(llm.engine, 2)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    per_prompt = llm.generate([[5, 6, 7]] * 3, greedy, lora_request=[None, *loras], use_tqdm=False)
    alone = [llm.generate([5, 6, 7], greedy, lora_request=lora, use_tqdm=False)[0] for lora in [None, *loras]]
    assert [o.token_ids for o in per_prompt] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in alone}) == 3
    try:
        llm.generate([5], greedy, lora_request=LoRARequest("nowhere", 9, "/no/such/adapter"), use_tqdm=False)
    except ValueError as error:
        assert "LoRA adapter 'nowhere': /no/such/adapter: no such directory" in str(error)
    else:
        raise AssertionError("a missing adapter was accepted")
    assert not llm.engine.has_unfinished()


def test_the_three_candidate_forms_equal_a_per_token_reference():
    """The masked dense form the forward uses, a gather of each token's weights and a grouped GEMM
    (jax.lax.ragged_dot over tokens sorted by slot) all compute the per-token numpy loop."""
    rng = np.random.default_rng(0)
    t, i, o, m, r = 40, 24, 20, 4, 8
    x = rng.standard_normal((t, i), np.float32)
    a = rng.standard_normal((m, i, r), np.float32)
    b = rng.standard_normal((m, r, o), np.float32)
    slots = np.sort(rng.integers(0, m + 1, t)).astype(np.int32)
    slots = np.concatenate([slots[slots > 0], slots[slots == 0]])  # sorted by slot, no adapter last
    expected = reference_delta(x, a, b, slots)
    assert np.abs(expected).max() > 1
    sizes = np.bincount(slots, minlength=m + 1)[1:].astype(np.int32)
    with jax.default_matmul_precision("highest"):  # a GPU's f32 matmuls would take TF32
        np.testing.assert_allclose(dense_delta(x, a.transpose(1, 0, 2), b, slots), expected, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(gather_delta(x, a, b, slots), expected, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(ragged_dot_delta(x, a, b, sizes), expected, rtol=1e-5, atol=1e-4)
    mask = np.asarray(LoRATokens.of(slots, m, np.float32).mask)
    assert (mask.sum(1) == (slots > 0)).all()


def test_prefix_caching_never_shares_pages_across_adapters():
    """The adapter is in every page's key: the same prompt under two adapters (or none) computes its
    pages once each; under the same adapter again it hits. Tokens equal a run without caching."""
    prompt = list(range(20, 20 + 4 * 4 + 1))  # four full pages of 4 tokens

    def run(prefix_caching):
        engine = lora_engine(prefix_caching=prefix_caching, async_scheduling=False)
        first, second = add_random_adapters(engine, 2)
        outputs = []
        for lora in (None, first, second, first, None):
            engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), lora_request=lora)
            while engine.has_unfinished():
                outputs += [(o.output_token_ids, o.num_cached_tokens) for o in engine.step() if o.finished]
        return outputs

    cached, plain = run(True), run(False)
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in plain]
    assert [hits for _, hits in cached] == [0, 0, 0, 16, 16]  # only the repeats of an adapter (or of none) hit


def test_small_buckets_read_each_tokens_slot_and_match_the_masked_form():
    """Buckets of at most SMALL_BATCH_TOKENS read only each token's slot, gathered (XLA) or through the
    Pallas kernels (interpreted; also compiled on a GPU): every fused projection's output with its term equals the masked
    dense form's, tokens without an adapter included, in f32 and in bf16."""
    import jax
    import jax.numpy as jnp

    from orca_jax.lora import ops
    from orca_jax.lora.layout import layer_shapes, nest
    from orca_jax.models.presets import get_preset

    config = get_preset("tiny-llama")
    rng = np.random.default_rng(0)
    h, n, k, d, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_size
    slots = jnp.asarray([0, 2, 1, 3, 3, 0, 1, 2], jnp.int32)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
        table = nest({p: rand(*s) for p, s in layer_shapes(config, 3, 4).items()})
        dense = ops.LoRATokens.of(slots, 3, dtype).without_rows()
        x, attn, act = rand(8, h), rand(8, n, d), rand(8, f)
        cases = ((ops.add_qkv, x, table["attn"]["qkv"], rand(8, k, n // k + 2, d)),
                 (ops.add_o, attn, table["attn"]["o"], rand(8, h)),
                 (ops.add_gate_up, x, table["mlp"]["gate_up"], rand(8, 2, f)),
                 (ops.add_in, act, table["mlp"]["down"], rand(8, h)))
        forms = [ops.SmallBatchForm.GATHER, ops.SmallBatchForm.KERNEL_INTERPRET]
        forms += [ops.SmallBatchForm.KERNEL] if jax.devices()[0].platform == "gpu" else []
        for small in forms:
            tokens = ops.LoRATokens.of(slots, 3, dtype, small)
            assert tokens.rows is not None and slots.shape[0] <= ops.SMALL_BATCH_TOKENS
            assert tokens.kernel == (small is not ops.SmallBatchForm.GATHER)
            for fn, inputs, weights, base in cases:
                with jax.default_matmul_precision("highest"):  # a GPU's f32 matmuls would take TF32
                    want = np.asarray(fn(base, inputs, weights, dense), np.float32)
                    got = np.asarray(fn(base, inputs, weights, tokens), np.float32)
                scale = np.abs(want).max()
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=f"{fn.__name__} {small}")
            # Tokens without an adapter keep the base output exactly.
            out = np.asarray(ops.add_o(cases[1][3], attn, table["attn"]["o"], tokens))
            np.testing.assert_array_equal(out[np.asarray(slots) == 0], np.asarray(cases[1][3])[np.asarray(slots) == 0])


def test_the_decode_kernels_give_the_gathered_forms_tokens(monkeypatch):
    """The engine with the Pallas kernels for decode-sized buckets gives every request of a batch mixing three adapters and the base the greedy tokens of the engine
    with the gathered XLA form."""
    import jax

    from orca_jax.lora.ops import SmallBatchForm
    from orca_jax.worker import stage

    rng = random.Random(2)
    jobs = [([rng.randrange(3, 250) for _ in range(rng.randint(2, 9))], i % 4) for i in range(6)]

    def run():
        engine = lora_engine(max_loras=3, max_num_seqs=6)
        loras = [None, *add_random_adapters(engine, 3)]
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True), lora_request=loras[k])
               for p, k in jobs]
        done = drain(engine)
        return engine, [done[i] for i in ids]

    monkeypatch.setattr(stage, "small_batch_form", lambda *_: SmallBatchForm.GATHER)
    gathered_engine, gathered = run()
    assert gathered_engine.runner.stages[0].lora_small is SmallBatchForm.GATHER
    # Compiled on a GPU, interpreted elsewhere.
    kernel_form = SmallBatchForm.KERNEL if jax.devices()[0].platform == "gpu" else SmallBatchForm.KERNEL_INTERPRET
    monkeypatch.setattr(stage, "small_batch_form", lambda *_: kernel_form)
    kernel_engine, kernel = run()
    assert kernel_engine.runner.stages[0].lora_small is kernel_form
    assert kernel == gathered
