"""Decode forwards that sample their logits themselves (ForwardKey.sampled, worker/stage.py): the same
tokens as the forward followed by the sampling programs, one launch fewer, every buffer where it was.
The decode programs exist with the pallas backend (its kernels run interpreted on CPU)."""

import jax

from orca_jax.config import AttentionBackend, SamplingConfig
from orca_jax.sample.mode import SampleMode
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import ForwardKey, SampleKey

from tests.helpers.engines import drain, tiny_engine

PROMPTS = [[5, 6, 7], list(range(10, 31)), [40] * 5, [9, 8, 7, 6]]


def _sampling(i: int) -> SamplingParams:
    """Greedy, seeded samples (plain, then with top-k / top-p), a penalty and top logprobs (those two
    take the sampling programs)."""
    return [SamplingParams(max_tokens=7, ignore_eos=True),
            SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.9, seed=11),
            SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.7, top_k=5, top_p=0.9, seed=12),
            SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.8, seed=13, presence_penalty=0.5)][i]


def _run(fuse: bool, together: bool, logprobs: bool = False):
    engine = tiny_engine(attention=AttentionBackend.PALLAS, sampling=SamplingConfig(fuse_decode_sampling=fuse))
    outputs = {}
    for i, prompt in enumerate(PROMPTS):
        sampling = _sampling(i) if not logprobs else SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2)
        engine.add_request(prompt, sampling, request_id=str(i))
        if not together:
            outputs.update(drain(engine))
    outputs.update(drain(engine))
    sampled = {key for key in engine.runner.compilation.compiled_keys if isinstance(key, ForwardKey) and key.sampled >= 0}
    return outputs, sampled


def test_sampling_in_the_decode_forward_gives_the_sampling_programs_tokens():
    for together in (False, True):
        fused, fused_keys = _run(True, together)
        apart, apart_keys = _run(False, together)
        assert fused == apart and all(len(tokens) == 7 for tokens in fused.values())
        assert not apart_keys
        # Alone, the greedy and plainly sampled requests decode on the sampled forwards (both modes).
        if not together:
            assert {key.sampled for key in fused_keys} == {int(SampleMode.GREEDY), int(SampleMode.SAMPLE)}
    # A batch that asks for top logprobs keeps the sampling programs.
    _, keys = _run(True, together=True, logprobs=True)
    assert not keys


def test_sampled_decode_steps_launch_two_programs_with_every_buffer_where_it_was():
    """Steady decode runs the stage-in and the sampled forward only, and each step's forward finds its
    arguments and outputs at the addresses of the step before (the weights, the pages, the staged
    inputs, the samples it reads and overwrites). Only the packed result is new each step: the host
    reads it a step later, as it did the sampling program's (on GPU, the graph's one kernel writing it
    is updated)."""
    engine = tiny_engine(attention=AttentionBackend.PALLAS)
    assert engine.runner.sampled_decode
    compilation = engine.runner.compilation
    original = compilation.executable
    calls: list[tuple] = []

    def addresses(tree):
        return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]

    def recording(key):
        executable = original(key)

        def call(*args):
            before = addresses(args)
            out = executable(*args)
            calls.append((key, before, addresses(out)))
            return out
        return call

    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3))
    engine.step()
    engine.step()
    engine.drain()
    compilation.executable = recording  # noqa: a test's seam: what each program is given and gives back
    for _ in range(6):
        engine.step()
    engine.drain()
    forwards = [call for call in calls if isinstance(call[0], ForwardKey)]
    assert len(forwards) == 6 and all(key.sampled == int(SampleMode.SAMPLE) and key.decode for key, _, _ in forwards)
    assert not any(isinstance(key, SampleKey) for key, _, _ in calls)
    assert all(call[1] == forwards[0][1] and call[2][1:] == forwards[0][2][1:] for call in forwards)
    # The samples' buffer is read and written in place: an argument's address is an output's.
    assert set(forwards[0][2][1:]) <= set(forwards[0][1])


def test_precompiled_sampled_forwards_are_run_once_and_change_no_token():
    """Precompiling runs each sampled decode forward once on padding, on a samples buffer of its own
    (its CUDA graph is recorded before serving): the tokens are those of an engine that compiled on
    demand, and nothing compiles while serving."""
    def run(precompile: bool):
        engine = tiny_engine(attention=AttentionBackend.PALLAS, max_num_batched_tokens=16, precompile=precompile)
        compiled = set(engine.runner.compilation.compiled_keys)
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(prompt[:12], _sampling(i), request_id=str(i))
        return drain(engine), compiled, set(engine.runner.compilation.compiled_keys)

    warm, before, after = run(True)
    assert any(isinstance(key, ForwardKey) and key.sampled >= 0 for key in before) and after == before
    cold, _, _ = run(False)
    assert warm == cold
