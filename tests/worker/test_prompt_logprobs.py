"""SamplingParams.prompt_logprobs (worker/prompt_logprobs.py): the engine's extra forward over a prompt, checked
against numpy on the serving forward's own logits at every position, against transformers on a tiny
Hugging Face Llama, and on a tensor-parallel mesh of fake devices."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from orca_jax import LLM
from orca_jax.config import EngineConfig, ParallelConfig, SamplingConfig
from orca_jax.lora.request import LoRARequest
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import PromptLogprobsKey
from orca_jax.worker.prompt_logprobs import prompt_lengths

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.mesh import run_on_fake_devices
from tests.helpers.models import prompt_logits

MAX_LOGPROBS = 6
# fp32 on CPU: the packed dense forward and the paged serving forward differ by reassociation only.
LOGPROB_BOUND = 1e-5


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_model_len=128, sampling=SamplingConfig(max_logprobs=MAX_LOGPROBS,
                                                                  enable_prompt_logprobs=True))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def first_output(engine, prompt, sampling):
    request_id = engine.add_request(prompt, sampling)
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def check_against(reference: np.ndarray, prompt: list[int], got, k: int) -> None:
    """`reference`: f64[n, V] log_softmax of the next-token logits at each prompt position."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row = reference[i - 1]
        order = np.argsort(-row, kind="stable")
        token = prompt[i]
        position = got[i]
        assert list(position)[0] == token  # the prompt token first, as vLLM
        assert abs(position[token].logprob - row[token]) < LOGPROB_BOUND, i
        # Its rank as the reference counts it, give or take the logprobs within the device's f32
        # rounding of the token's (a near tie counts either way).
        above = int(np.sum(row > row[token] + LOGPROB_BOUND))
        near = int(np.sum(np.abs(row - row[token]) <= LOGPROB_BOUND))
        assert above + 1 <= position[token].rank <= above + near, i
        assert [t for _, t in sorted((lp.rank, t) for t, lp in position.items() if lp.rank <= k)] \
            == order[:k].tolist(), i
        for rank, t in enumerate(order[:k], 1):
            assert position[int(t)].rank == rank
            assert abs(position[int(t)].logprob - row[t]) < LOGPROB_BOUND
        assert len(position) in (k, k + 1)


@pytest.mark.parametrize("length", [1, 2, 16, 37, 127])  # bucket edges, a padded one, the longest
def test_prompt_logprobs_equal_numpy_log_softmax_of_the_full_sequence_logits(engine, length):
    prompt = [(7 * i + 3) % 250 + 3 for i in range(length)]
    k = 3 if length != 2 else 0
    outputs = first_output(engine, prompt, SamplingParams(max_tokens=1, prompt_logprobs=k))
    got = outputs[0].prompt_logprobs
    if length == 1:
        assert got == [None]
        return
    check_against(log_softmax(prompt_logits(engine.runner, prompt)), prompt, got, k)
    assert all(out.prompt_logprobs is None for out in outputs[1:])


def test_only_the_first_output_carries_them_and_requests_without_get_none(engine):
    prompt = list(range(20, 40))
    outputs = first_output(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    assert len(outputs) >= 2 and outputs[0].prompt_logprobs is not None
    assert [out.prompt_logprobs for out in outputs[1:]] == [None] * (len(outputs) - 1)
    plain = first_output(engine, prompt, SamplingParams(max_tokens=2))
    assert all(out.prompt_logprobs is None for out in plain)


def test_requests_in_flight_are_unaffected(engine):
    """A request added (its prompt forward run) while another's batches are in flight: both
    continue as they would alone."""
    alone = first_output(engine, [9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True))[-1].output_token_ids
    first = engine.add_request([9, 8, 7], SamplingParams(max_tokens=6, ignore_eos=True), request_id="a")
    engine.step()
    engine.add_request(list(range(50, 70)), SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2),
                       request_id="b")
    done = drain(engine)
    assert done[first] == alone and len(done["b"]) == 3


def test_refusals_name_the_field_and_the_flag(engine):
    with pytest.raises(ValueError, match=r"prompt_logprobs.*--enable-prompt-logprobs"):
        tiny_engine().add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs must be between 0 and 6"):
        engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1))
    with pytest.raises(ValueError, match=r"prompt_logprobs.*LoRA adapter"):
        engine.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1),
                           lora_request=LoRARequest("a", 1, "/nowhere"))
    with pytest.raises(ValueError, match="must be an int >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_model_len"):  # refused by the scheduler: no forward run for it
        engine.add_request(list(range(3, 131)), SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert not engine.has_unfinished()
    sampling = SamplingConfig(enable_prompt_logprobs=True)
    for parallel in (ParallelConfig(num_stages=2),
                     ParallelConfig(num_processes=2, coordinator_address="localhost:1")):
        with pytest.raises(ValueError, match="pipeline parallelism.*several controller processes"):
            EngineConfig(parallel=parallel, sampling=sampling)


def test_programs_are_added_only_when_enabled_and_precompiled_with_the_rest(engine):
    off = tiny_engine(max_model_len=128)
    lengths = prompt_lengths(128)
    assert lengths == [16, 32, 64, 128] and prompt_lengths(100) == [16, 32, 64, 100]
    assert not any(isinstance(key, PromptLogprobsKey) for key in off.program_keys())
    on = [key for key in engine.program_keys() if isinstance(key, PromptLogprobsKey)]
    assert on == [PromptLogprobsKey(n) for n in lengths]
    assert len(engine.program_keys()) == len(off.program_keys()) + len(lengths)
    engine.runner.precompile(on, warm=False)
    compiled = engine.runner.compilation.num_compiled_programs
    for length in (5, 17, 100):
        engine.runner.prompt_logprobs(list(range(3, 3 + length)), 2)
    assert engine.runner.compilation.num_compiled_programs == compiled  # nothing compiled on demand


def test_llm_returns_them_with_the_completion_logprobs():
    llm = LLM("tiny-llama", num_kv_pages=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
              enable_prompt_logprobs=True, max_logprobs=4)
    prompt = list(range(30, 45))
    out, plain = llm.generate([prompt, [5, 6]], [SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=4,
                                                               logprobs=1), SamplingParams(max_tokens=2)],
                              use_tqdm=False)
    reference = log_softmax(prompt_logits(llm.engine.runner, prompt))
    check_against(reference, prompt, out.prompt_logprobs, 4)
    assert plain.prompt_logprobs is None
    assert [item.token_id for item in out.outputs[0].logprobs] == out.token_ids


def test_prompt_logprobs_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.helpers.hf_dirs import write_hf_dir
    from tests.helpers.models import hf_offline

    hf_offline()
    theirs = write_hf_dir(str(tmp_path), "llama")
    engine = tiny_engine(str(tmp_path), sampling=SamplingConfig(max_logprobs=5, enable_prompt_logprobs=True))
    prompt = [int(t) for t in np.random.default_rng(0).integers(4, 300, size=40)]
    got = first_output(engine, prompt, SamplingParams(max_tokens=1, prompt_logprobs=5))[0].prompt_logprobs
    with torch.no_grad():
        logits = theirs(torch.tensor([prompt])).logits[0].double().numpy()
    check_against(log_softmax(logits), prompt, got, 5)


TP_SCRIPT = textwrap.dedent("""
    import json
    from tests.helpers.engines import tiny_engine
    from orca_jax.config import ParallelConfig, SamplingConfig
    from orca_jax.sampling_params import SamplingParams

    prompt = [(11 * i + 5) % 250 + 3 for i in range(45)]
    results = {}
    for tp in (1, 2):
        engine = tiny_engine(max_model_len=64, parallel=ParallelConfig(tensor_parallel=tp),
                             sampling=SamplingConfig(max_logprobs=4, enable_prompt_logprobs=True))
        engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=4), request_id="r")
        got = None
        while engine.has_unfinished():
            for out in engine.step():
                got = got or out.prompt_logprobs
        results[tp] = [None if p is None else [[t, lp.logprob, lp.rank] for t, lp in p.items()] for p in got]
    print(json.dumps(results))
""")


def test_tensor_parallel_matches_one_device():
    results = run_on_fake_devices(2, "-c", TP_SCRIPT)
    one, two = results["1"], results["2"]
    assert one[0] is None and two[0] is None and len(one) == len(two) == 45
    for a, b in zip(one[1:], two[1:]):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        assert [r for _, _, r in a] == [r for _, _, r in b]
        np.testing.assert_allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b], atol=1e-5)
