"""Every sampling parameter through the engine (tiny random-weight model, fp32 CPU): penalties against a
host reference of vLLM's formulas, and equal tokens alone, batched, with async scheduling on and off and
under preemption; bad words never emitted; min_tokens, logit_bias, allowed_token_ids, special tokens;
the offline LLM API."""

import random

import numpy as np
import pytest

from orca_jax.config import KVAllocation
from orca_jax.sampling_params import SamplingParams

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.models import prompt_logits

PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.8, frequency_penalty=0.6)


def reference_greedy_with_penalties(runner, prompt, max_tokens, repetition, presence, frequency):
    """Greedy decoding on full-prefix logits with vLLM's penalties applied on the host (numpy)."""
    outputs: list[int] = []
    for _ in range(max_tokens):
        x = prompt_logits(runner, prompt + outputs)[-1].astype(np.float64)
        counts = np.bincount(np.asarray(outputs, int), minlength=x.shape[0])
        seen = counts > 0
        seen[prompt] = True
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        outputs.append(int(np.argmax(x)))
    return outputs


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(5)
    # Short vocabularies of prompt tokens, so the model repeats itself and the penalties bite.
    prompts = [[rng.choice([40, 41, 42, 43, 44]) for _ in range(rng.randint(3, 14))] for _ in range(6)]
    kinds = [dict(PENALTIES), dict(PENALTIES, temperature=0.9, top_k=20, seed=3), dict(),
             dict(repetition_penalty=1.3, temperature=1.1, top_p=0.8, seed=4), dict(PENALTIES),
             dict(temperature=0.7, min_p=0.1, seed=5)]
    return [(p, SamplingParams(max_tokens=12, ignore_eos=True, **k)) for p, k in zip(prompts, kinds)]


def test_greedy_penalties_equal_the_host_reference(requests):
    engine, reference = tiny_engine(), tiny_engine(seed=0)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(i))
    together = drain(engine)
    for i, (prompt, params) in enumerate(requests):
        if params.greedy and params.uses_penalties:
            expected = reference_greedy_with_penalties(reference.runner, prompt, params.max_tokens,
                                                       params.repetition_penalty, params.presence_penalty,
                                                       params.frequency_penalty)
            assert together[str(i)] == expected, i
    plain = [o for i, o in together.items() if not requests[int(i)][1].uses_penalties and requests[int(i)][1].greedy]
    assert plain and all(len(set(o)) < len(o) for o in plain)  # unpenalized, the model repeats itself


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalties_give_the_same_tokens_batched_async_and_preempted(requests, async_scheduling):
    """Each request alone, then all together (async scheduling on or off), then together in a pool so
    small that requests are preempted and their penalty slots rebuilt: the same tokens every time."""
    engine = tiny_engine(async_scheduling=async_scheduling)
    alone = []
    for prompt, params in requests:
        engine.add_request(prompt, params, request_id="alone")
        alone.append(drain(engine)["alone"])
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(i))
    together = drain(engine)
    assert [together[str(i)] for i in range(len(requests))] == alone
    small = tiny_engine(num_pages=11, max_num_seqs=6, max_num_batched_tokens=32, async_scheduling=async_scheduling,
                        scheduler_options={"kv_allocation": KVAllocation.ON_DEMAND})
    for i, (prompt, params) in enumerate(requests):
        small.add_request(prompt, params, request_id=str(i))
    preempted = drain(small)
    assert small.stats().num_preemptions > 0
    assert [preempted[str(i)] for i in range(len(requests))] == alone


def _bigrams(tokens):
    return set(zip(tokens, tokens[1:]))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_are_never_emitted(async_scheduling):
    """Greedy and sampled outputs, then the same requests with the tokens and token pairs they emitted
    as bad words: none appears again (byte vocabulary: a word's bytes are its tokens)."""
    engine = tiny_engine(async_scheduling=async_scheduling)
    prompts = [[40, 41, 42], [50] * 6, list(range(60, 75))]
    kinds = [dict(), dict(temperature=1.0, seed=1)]
    first = {}
    for i, prompt in enumerate(prompts):
        for j, kind in enumerate(kinds):
            engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True, **kind), request_id=f"{i}/{j}")
    first = drain(engine)
    printable = lambda t: 33 <= t < 127  # noqa: E731  a one-byte word that survives lstrip()
    for i, prompt in enumerate(prompts):
        for j, kind in enumerate(kinds):
            out = first[f"{i}/{j}"]
            singles = sorted({t for t in out if printable(t)})[:2]
            pairs = sorted((a, b) for a, b in _bigrams(out) if printable(a) and b < 128 and a not in singles)[:3]
            words = [chr(t) for t in singles] + [chr(a) + chr(b) for a, b in pairs]
            assert words, out
            engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True, bad_words=words, **kind),
                               request_id=f"{i}/{j}")
            again = drain(engine)[f"{i}/{j}"]
            assert not set(singles) & set(again), (words, again)
            assert not set(pairs) & _bigrams(again), (words, again)


def test_min_tokens_logit_bias_allowed_tokens_and_special_tokens():
    engine = tiny_engine()
    prompt = [40, 41, 42, 43]
    engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), request_id="free")
    first = drain(engine)["free"][0]
    # min_tokens: the first token is a stop token, banned until 4 outputs.
    engine.add_request(prompt, SamplingParams(max_tokens=6, stop_token_ids=[first]), request_id="stop")
    engine.add_request(prompt, SamplingParams(max_tokens=6, stop_token_ids=[first], min_tokens=4), request_id="min")
    out = drain(engine)
    assert out["stop"] == [first]
    assert len(out["min"]) >= 4 and first not in out["min"][:4]
    # logit_bias: a large bias wins every greedy step; allowed_token_ids: samples stay inside.
    engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}), request_id="bias")
    engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.5, seed=2,
                                              allowed_token_ids=[65, 66, 67]), request_id="allowed")
    out = drain(engine)
    assert out["bias"] == [77] * 5 and set(out["allowed"]) <= {65, 66, 67} and len(set(out["allowed"])) > 1
    # skip_special_tokens: the byte vocabulary's EOS (2) stays out of the text unless asked for.
    # (Byte-level vocabularies decode a special token to its own text, no spaces around it, whatever
    # spaces_between_special_tokens says: as vLLM's fast detokenizer.)
    texts = {}
    for skip, spaces in ((True, True), (False, True), (False, False)):
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={2: 100.0},
                                                  skip_special_tokens=skip, spaces_between_special_tokens=spaces),
                           request_id="special")
        texts[skip, spaces] = engine_text(engine, "special")
    assert texts == {(True, True): "", (False, True): "\x02" * 3, (False, False): "\x02" * 3}


def engine_text(engine, request_id):
    while True:
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out.text


def test_engine_refuses_what_it_cannot_honour():
    engine = tiny_engine()
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        engine.add_request([5], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        engine.add_request([5], SamplingParams(logit_bias={256: 1.0}))
    with pytest.raises(ValueError, match="logit_table_width"):
        engine.add_request([5], SamplingParams(logit_bias={i: 1.0 for i in range(65)}))


def test_llm_generate_takes_every_sampling_parameter():
    """The offline API end to end: the new SamplingParams fields through LLM.generate."""
    from orca_jax import LLM
    from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
    # (max_num_seqs 3: worker/test_executable_cache counts re-serialized programs; on CPU one that jax's
    # session cache already holds from here could not be serialized again.)
    llm = LLM(engine_config=EngineConfig(model="tiny-llama", cache=CacheConfig(page_size=4, num_pages=64),
                                         scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32),
                                         precompile=False))
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, min_p=0.05, seed=1,
                             presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, bad_words=["A"],
                             logit_bias={66: 2.0}),
              SamplingParams(max_tokens=8, min_tokens=8, allowed_token_ids=[65, 66, 67, 2], stop_token_ids=[2])]
    outs = llm.generate(["Hi", "Yo"], params, use_tqdm=False)
    assert len(outs[0].token_ids) == 8 and 65 not in outs[0].token_ids
    assert len(outs[1].token_ids) == 8 and set(outs[1].token_ids) <= {65, 66, 67}
    assert llm.stats().kv_pages_used == 0


class EvenTokensFrom:
    """A token-mask source (the seam structured output fills): even tokens only, from a given step on."""

    def __init__(self, from_step: int):
        self.from_step = from_step
        self.asked: list[tuple[str, int]] = []

    def token_mask(self, request, step):
        self.asked.append((request.request_id, step))
        if not request.request_id.startswith("even") or step < self.from_step:
            return None
        from orca_jax.sample.rules import pack_token_mask
        return pack_token_mask(range(0, 256, 2), 256)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_token_masks_from_outside_apply_on_device(async_scheduling):
    from orca_jax.engine import Engine
    source = EvenTokensFrom(from_step=2)
    base = tiny_engine(async_scheduling=async_scheduling)
    engine = Engine(base.config, token_masks=source)
    for kind in (dict(), dict(temperature=1.2, seed=5), dict(repetition_penalty=1.4, allowed_token_ids=[7, 8, 9, 10])):
        engine.add_request([40, 41, 42], SamplingParams(max_tokens=10, ignore_eos=True, **kind), request_id="even")
        engine.add_request([40, 41, 42], SamplingParams(max_tokens=10, ignore_eos=True, **kind), request_id="free")
        out = drain(engine)
        base.add_request([40, 41, 42], SamplingParams(max_tokens=10, ignore_eos=True, **kind), request_id="free")
        unconstrained = drain(base)["free"]
        assert all(t % 2 == 0 for t in out["even"][2:]), out["even"]
        assert out["free"] == unconstrained  # the mask is its row's only
        if "temperature" in kind:  # the same seed unconstrained draws odd tokens: the mask made them even
            assert any(t % 2 for t in unconstrained[2:]), unconstrained
        if "allowed_token_ids" in kind:  # both masks: their intersection
            assert set(out["even"][2:]) <= {8, 10} and set(out["free"]) <= {7, 8, 9, 10}
    assert ("even", 0) in source.asked and ("even", 9) in source.asked
