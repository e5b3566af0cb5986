"""LoRA adapters made by peft on tiny Llama, Qwen2 and GPT-2 models: our logits and greedy tokens equal
transformers + peft's, alone and mixed in one batch with other adapters and the base model."""

from __future__ import annotations

import numpy as np
import pytest

from orca_jax.config import AttentionBackend, CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from orca_jax.engine import Engine
from orca_jax.lora import LoRARequest
from orca_jax.lora.adapter import load_adapter
from orca_jax.models.loader import load_model
from orca_jax.sampling_params import SamplingParams

from tests.helpers.lora import MAX_RANK, write_adapters, write_base
from tests.helpers.models import hf_greedy, hf_logits, hf_offline, prompt_logits

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
hf_offline()

KINDS = ("llama", "qwen2", "gpt2")
# Max |ours - peft| over 24 positions x the vocabulary, fp32 on CPU, |logits| <= ~1.7: measured at
# most 1.5e-5 (Qwen2, all seven projections; 1e-6 to 9e-6 for the others).
LOGIT_BOUND = 5e-5


def lora_engine(loaded, max_loras: int, max_num_seqs: int = 8) -> Engine:
    config = EngineConfig(cache=CacheConfig(page_size=8, num_pages=128),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                          attention=AttentionBackend.JNP, precompile=False,
                          lora=LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK))
    return Engine(config, loaded)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(kind) -> (transformers base, {name: (path, peft model)}, LoadedModel, engine with four
    adapter slots), made once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            base_dir = str(tmp_path_factory.mktemp(kind))
            base = write_base(base_dir, kind)
            adapters = write_adapters(base, str(tmp_path_factory.mktemp(f"{kind}-adapters")), kind)
            loaded = load_model(base_dir)
            cache[kind] = (base, adapters, loaded, lora_engine(loaded, max_loras=4))
        return cache[kind]

    return get


def requests_of(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(adapters.items())}


def generate(engine: Engine, jobs: list[tuple[list[int], LoRARequest | None]], max_tokens: int = 12) -> list[list[int]]:
    """All jobs submitted at once; each one's greedy tokens, in order."""
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), lora_request=lora)
           for prompt, lora in jobs]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out.output_token_ids) for out in engine.step() if out.finished)
    return [done[i] for i in ids]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_peft(built, kind):
    base, adapters, _, engine = built(kind)
    assert not engine.lora.slots.resident  # slot 4 is written here behind the engine's back
    ids = np.random.default_rng(0).integers(3, 250, size=24).tolist()
    engine.drain()  # the runner is called from here below
    for name, (path, theirs) in adapters.items():
        engine.runner.load_lora(4, load_adapter(path, name, engine.model_config, MAX_RANK))
        expected = hf_logits(theirs, ids)
        assert np.abs(expected - hf_logits(base, ids)).max() > 1e-2, name  # the adapter matters
        ours = prompt_logits(engine.runner, ids, lora_slot=4)[:, :expected.shape[1]]
        assert np.abs(ours - expected).max() < LOGIT_BOUND, (name, np.abs(ours - expected).max())
    base_logits = prompt_logits(engine.runner, ids)[:, :expected.shape[1]]  # slot 0: the base model
    assert np.abs(base_logits - hf_logits(base, ids)).max() < LOGIT_BOUND


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_peft_alone_and_mixed(built, kind):
    """Each adapter's greedy tokens equal peft's; then all four adapters and two base requests in
    one batch (four slots) give each request the tokens it got alone."""
    base, adapters, loaded, engine = built(kind)
    loras = requests_of(adapters)
    rng = np.random.default_rng(1)
    prompts = {name: rng.integers(3, 250, size=int(rng.integers(3, 6))).tolist() for name in [*loras, "base-a", "base-b"]}
    jobs = [(prompts[name], loras.get(name)) for name in prompts]
    alone = [generate(engine, [job])[0] for job in jobs]
    for (prompt, lora), tokens in zip(jobs, alone):
        theirs = base if lora is None else adapters[lora.lora_name][1]
        assert tokens == hf_greedy(theirs, prompt, 12, loaded.config.eos_token_ids), lora
    assert len({tuple(t) for t in alone}) == len(alone)  # every adapter says something else
    mixed = generate(engine, jobs)
    assert mixed == alone


def test_more_adapters_than_slots(built):
    """Four adapters, two slots: requests wait for a slot without holding up the base requests, slots
    are swapped least recently used first, and every request gets the tokens it gets alone."""
    _, adapters, loaded, _ = built("llama")
    engine = lora_engine(loaded, max_loras=2)
    loras = list(requests_of(adapters).values())
    prompts = [[5 + i, 9, 14, 3 + i] for i in range(6)]
    jobs = [(prompts[i], loras[i % 4] if i < 4 else None) for i in range(6)] * 2
    alone = [generate(engine, [job])[0] for job in jobs[:6]] * 2
    loads_before = engine.lora.num_loads
    mixed = generate(engine, jobs)
    assert mixed == alone
    assert engine.lora.num_loads - loads_before >= 4  # every adapter went through the two slots
    assert len(engine.lora.slots.resident) == 2
