"""The engine end to end on tiny random-weight models (fp32, CPU)."""

import random

import numpy as np
import pytest

from orca_jax.config import SchedulerConfig
from orca_jax.core.sched.interface import QueueFullError
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import ForwardKey, StageInKey
from orca_jax.worker.input_batch import unpack_forward_inputs

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.models import prompt_logits


def _random_requests(rng: random.Random, n: int, max_prompt: int = 40, max_new: int = 16):
    return [([rng.randrange(3, 256) for _ in range(rng.randint(1, max_prompt))],
             rng.randint(1, max_new), rng.randint(0, 12)) for _ in range(n)]


@pytest.mark.parametrize("model,shorten", [("tiny-llama", False), ("tiny-gpt", False), ("tiny-llama", True)])
def test_mixed_batch_equals_each_request_alone(model, shorten):
    """Requests joining at different iterations, chunked prompts included, change nobody's tokens;
    nor does shortening prompt chunks so batches feed a multiple of 8 tokens (BucketPolicy.token_target
    with buckets from 8 tokens on)."""
    rng = random.Random(0)
    requests = _random_requests(rng, 18 if model == "tiny-llama" else 10)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32)
    factory = None if not shorten else lambda kv, max_len, stages: Scheduler(
        config, kv, max_len, stages, token_target=lambda n: n - n % 8 if n >= 8 else n)
    # Prefix caching off: the batched run would find the alone runs' prompts cached and feed fewer tokens.
    engine = tiny_engine(model, max_num_seqs=6, max_num_batched_tokens=32, scheduler_factory=factory,
                         prefix_caching=False)
    fed = []
    engine.add_observer(type("Fed", (), {"on_dispatch": lambda self, batch, timing: fed.append(batch.num_real_tokens),
                                         "on_update": lambda self, output, seconds: None})())
    alone = []
    for prompt, max_new, _ in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=max_new, ignore_eos=True), request_id="alone")
        alone.append(drain(engine)["alone"])

    pending = sorted(enumerate(requests), key=lambda r: r[1][2])  # by arrival iteration
    together, iteration = {}, 0
    before = engine.stats()
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= iteration:
            i, (prompt, max_new, _) = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_new, ignore_eos=True), request_id=str(i))
        for out in engine.step():
            if out.finished:
                together[int(out.request_id)] = out.output_token_ids
        iteration += 1
    after = engine.stats()
    mean_batch = (after.batch_size_total - before.batch_size_total) / (after.iterations - before.iterations)
    assert mean_batch > 2  # they really shared batches
    for i, expected in enumerate(alone):
        assert together[i] == expected, f"request {i} differs when batched"
        assert len(expected) == requests[i][1]
    # Batches of 8+ tokens feeding a multiple of 8 (the rest: prompts alone, or too few prompt tokens
    # to give up): 0.71 shortened, 0.37-0.44 not.
    aligned = sum(n % 8 == 0 for n in fed if n >= 8) / sum(n >= 8 for n in fed)
    assert aligned > 0.6 if shorten else aligned < 0.5, aligned


def test_late_request_joins_at_next_iteration_and_finished_leaves_at_once():
    # Algorithm 1 exactly: with async scheduling the next batch is already planned when step() returns,
    # so a late request's first token reaches the host one step later (test_async_scheduling_*).
    engine = tiny_engine(async_scheduling=False)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), request_id="early")
    engine.step()
    engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True), request_id="late")
    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {"early", "late"}  # the late one ran in the very next iteration
    outs = {o.request_id: o for o in engine.step()}
    assert outs["late"].finished and outs["late"].finish_reason == "length"
    assert engine.stats().num_running == 1  # gone in the iteration it finished
    drain(engine)
    assert engine.stats().kv_pages_used == 0


def test_abort_frees_kv_at_once_and_emits_nothing_more():
    engine = tiny_engine()
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.add_request(list(range(3, 10)), SamplingParams(max_tokens=5, ignore_eos=True), request_id="b")
    engine.step()
    engine.step()
    used = engine.stats().kv_pages_used
    assert engine.abort("a")
    assert engine.stats().kv_pages_used < used
    finished = drain(engine)
    assert set(finished) == {"b"}
    assert engine.stats().kv_pages_used == 0 and engine.stats().kv_pages_reserved == 0
    assert not engine.abort("a")


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    engine = tiny_engine()
    engine.add_request([10, 11, 12], params, request_id="x")
    alone = drain(engine)["x"]
    rng = random.Random(1)
    for i, (prompt, max_new, _) in enumerate(_random_requests(rng, 5)):
        engine.add_request(prompt, SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True))
    engine.add_request([10, 11, 12], params, request_id="x")
    assert drain(engine)["x"] == alone
    engine.add_request([10, 11, 12], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True),
                       request_id="y")
    assert drain(engine)["y"] != alone  # a different seed draws differently


def test_stop_conditions_and_logprobs():
    engine = tiny_engine()
    engine.add_request([20, 21, 22], SamplingParams(max_tokens=8, ignore_eos=True), request_id="ref")
    reference = drain(engine)["ref"]
    stop_token = reference[3]
    engine.add_request([20, 21, 22], SamplingParams(max_tokens=8, stop_token_ids=(stop_token,), ignore_eos=True,
                                                    logprobs=2), request_id="s")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = outs[-1]
    assert final.finish_reason == "stop"
    assert final.output_token_ids == reference[:reference.index(stop_token) + 1]
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in logprobs] == final.output_token_ids
    for lp in logprobs:  # greedy: the sampled token is the most likely one
        assert len(lp.top) == 2 and max(lp.top, key=lp.top.get) == lp.token_id
        assert lp.logprob == pytest.approx(max(lp.top.values()), abs=1e-5)


def test_stop_string_cuts_text():
    engine = tiny_engine()
    engine.add_request("hello", SamplingParams(max_tokens=12, ignore_eos=True), request_id="ref")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    text = outs[-1].text
    stop = text[4:6]
    if not stop or stop.isspace():
        pytest.skip("random weights produced no usable stop string")
    engine.add_request("hello", SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True), request_id="s")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].text == text[:text.index(stop)]
    assert "".join(o.new_text for o in outs) == outs[-1].text


def test_bad_requests_are_refused_at_add_time():
    engine = tiny_engine(num_pages=17)  # 16 usable pages of 4 tokens
    with pytest.raises(ValueError, match="max_model_len|model"):
        engine.add_request([5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="pool|pages"):
        engine.add_request([5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 999999], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished()


def test_full_waiting_pool_pushes_back():
    engine = tiny_engine(scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_waiting=3))
    for _ in range(3):
        engine.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request([5, 6], SamplingParams(max_tokens=2))
    drain(engine)


def test_precompile_covers_every_batch_so_nothing_compiles_while_serving():
    """The documented program count: per token bucket a forward and the stage-in that copies its inputs
    into the bucket's staged buffer (one stage here), the sampling family per S, and the penalty fill.

    With max_num_seqs 16 and a 64-token budget the ladder is 8, 16, 32, 64 (4 forward programs, 4
    stage-in) and S is 8 or 16 (the next power of two of T, capped at the batch size). Per S the
    sampling family is 8 programs (sampler.sample_variants): GREEDY and SAMPLE, each with top-K 0 or
    20, and GREEDY, SAMPLE, SEARCH, SEARCH_TOP_K with logits processing (top-K 20); then one
    penalty-table fill: 4 + 4 + 2 x 8 + 1 = 25 in all. Two randomized 200-request runs over every sampling parameter
    then compile nothing more.
    """
    engine = tiny_engine(max_num_seqs=16, max_num_batched_tokens=64, num_pages=400, precompile=True)
    assert engine.buckets.ladder == (8, 16, 32, 64)
    compilation = engine.runner.compilation
    compiled = compilation.compiled_keys
    assert len(compiled) == compilation.num_compiled_programs == 4 + 4 + 2 * 8 + 1
    assert compiled == frozenset(engine.program_keys())

    def run(seed):
        rng = random.Random(seed)
        pending = _random_requests(rng, 200, max_prompt=30, max_new=8)
        while pending or engine.has_unfinished():
            while pending and rng.random() < 0.5:
                prompt, max_new, _ = pending.pop()
                extra = rng.choice([{}, {}, {"top_k": 20}, {"top_p": 0.9}, {"top_k": 500, "top_p": 0.8},
                                    {"min_p": 0.1}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                                    {"logit_bias": {7: 2.0}}, {"bad_words": ["ab"]}, {"min_tokens": 1},
                                    {"allowed_token_ids": [5, 6, 7]}])
                sampling = SamplingParams(max_tokens=max_new, ignore_eos=True,
                                          temperature=rng.choice([0.0, 0.8]), logprobs=rng.choice([None, 2]),
                                          **extra)
                engine.add_request(prompt, sampling)
            engine.step()

    for seed in (0, 1):
        run(seed)
        assert compilation.compiled_keys == compiled
        assert compilation.num_compiled_programs == len(compiled)
    assert engine.stats().kv_pages_used == 0


def test_pallas_backend_gives_the_jnp_backend_tokens():
    """The engine flag switches the attention implementation, and with it the layer kernel (RoPE + page
    write) and the decode programs (one attention pass); the kernels run interpreted on CPU."""
    from orca_jax.config import AttentionBackend
    from orca_jax.worker.compilation import ForwardKey
    prompts = [[5, 6, 7], list(range(10, 31)), [40] * 5]
    results, decode_keys = [], []
    for backend in (AttentionBackend.JNP, AttentionBackend.PALLAS, AttentionBackend.PALLAS_ATTENTION):
        engine = tiny_engine(attention=backend)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), request_id=str(i))
        results.append(drain(engine))
        decode_keys.append({key for key in engine.runner.compilation.compiled_keys
                            if isinstance(key, ForwardKey) and key.decode})
        # Precompiling lists decode forwards for the buckets up to max_num_seqs' (8 tokens), only for PALLAS.
        listed = {key.bucket.tokens for key in engine.program_keys() if isinstance(key, ForwardKey) and key.decode}
        assert listed == ({8} if backend is AttentionBackend.PALLAS else set())
    assert results[0] == results[1] == results[2]
    # The PALLAS engine ran its decode batches on the decode programs; the others have none.
    assert decode_keys[1] and not decode_keys[0] and not decode_keys[2]


def test_pallas_kernels_write_fp8_pages_as_the_jnp_path_does():
    """e4m3 KV pages written by the RoPE + page-write kernel and read by the attention kernel give the
    jnp path's tokens (both round the same float32 values to e4m3)."""
    from orca_jax.config import AttentionBackend, KVCacheDtype
    results = []
    for backend in (AttentionBackend.JNP, AttentionBackend.PALLAS):
        engine = tiny_engine(attention=backend, kv_cache_dtype=KVCacheDtype.FP8)
        for i, prompt in enumerate([[5, 6, 7], list(range(10, 31))]):
            engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), request_id=str(i))
        results.append(drain(engine))
    assert results[0] == results[1] and all(len(t) == 6 for t in results[0].values())


def test_async_scheduling_plans_ahead_and_changes_no_token():
    """Iteration k+1 is dispatched before k's tokens reach the host (its increment tokens come from
    the device), and every request's tokens equal the synchronous engine's, stop tokens included."""
    rng = random.Random(7)
    requests = _random_requests(rng, 12, max_prompt=20, max_new=9)

    def run(overlap: bool, stops: dict[int, int]):
        engine = tiny_engine(async_scheduling=overlap)
        planned_ahead = []

        class Watch:
            def on_dispatch(self, batch, timing):
                planned_ahead.append(batch.token_sources is not None)

            def on_update(self, output, seconds):
                pass

        engine.add_observer(Watch())
        for i, (prompt, max_new, _) in enumerate(requests):
            sampling = SamplingParams(max_tokens=max_new, temperature=0.7 if i % 3 == 0 else 0.0,
                                      stop_token_ids=(stops[i],) if i in stops else ())
            engine.add_request(prompt, sampling, request_id=str(i))
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id not in outputs, "one finished output per request"
                if out.finished:
                    outputs[out.request_id] = (out.output_token_ids, out.finish_reason)
        assert engine.stats().kv_pages_used == 0 and engine.stats().kv_pages_reserved == 0
        assert any(planned_ahead) == overlap
        return outputs

    free = run(False, {})
    # Stop every other request at its third token: a stop decided one iteration late under async.
    stops = {i: free[str(i)][0][2] for i in range(0, 12, 2) if len(free[str(i)][0]) > 3}
    expected = run(False, stops)
    assert expected == run(True, stops)
    assert {reason for _, reason in expected.values()} == {"stop", "length"}


def test_injected_scheduler_and_observer_seams():
    """A scheduler factory with its own policy object goes in through the constructor; an observer
    sees each dispatched batch and update, with the engine's own phase timings."""
    import functools

    from orca_jax.core.sched.policies import FCFS

    class LastArrivalFirst(FCFS):
        def sort_key(self, request):
            return (-request.arrival_time,)

    class Recorder:
        def __init__(self):
            self.dispatched, self.updates = [], 0

        def on_dispatch(self, batch, timing):
            self.dispatched.append((batch.num_real_seqs, timing.build_s >= 0 and timing.dispatch_s >= 0))

        def on_update(self, output, seconds):
            self.updates += 1

    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    engine = tiny_engine(scheduler_factory=lambda kv, max_len, stages: Scheduler(
        config, kv, max_len, stages, policy=LastArrivalFirst()))
    recorder = Recorder()
    engine.add_observer(recorder)
    engine.add_request([5, 6], SamplingParams(max_tokens=2, ignore_eos=True), request_id="first")
    engine.add_request([7, 8], SamplingParams(max_tokens=2, ignore_eos=True), request_id="second")
    assert [o.request_id for o in engine.step()] == ["second"]  # the injected policy's order
    drain(engine)
    assert recorder.dispatched == [(1, True)] * 4 and recorder.updates == 4
    engine.remove_observer(recorder)
    assert isinstance(engine.replace_scheduler(functools.partial(Scheduler, config)), Scheduler)


def test_the_forward_updates_every_layers_kv_in_place():
    """Per-layer K/V donated as a whole: XLA aliases every layer's pages to the program's outputs and
    keeps no second copy of the cache (temporaries far below the pool's size). The logits buffer
    f32[max_num_seqs, V] is aliased too."""
    engine = tiny_engine(num_pages=2048, page_size=4)
    runner = engine.runner
    kv_bytes = runner.kv_bytes + 4 * runner.max_num_seqs * runner.config.vocab_size
    buckets = engine.buckets.all_buckets()
    for bucket in (buckets[0], buckets[-1]):
        key = ForwardKey(bucket, stage=0)  # the only stage
        stats = engine.runner.compilation.executable(key).memory_analysis()
        assert stats.alias_size_in_bytes == kv_bytes
        assert stats.temp_size_in_bytes < kv_bytes / 4, (stats.temp_size_in_bytes, kv_bytes)


def test_logits_and_samples_stay_in_one_buffer_each_from_step_to_step():
    """The forward writes its logits into the runner's buffer and sampling writes the samples over the
    previous ones (both donated), so on GPU the forward's CUDA graph finds every argument where it was
    recorded; the tokens are those of a fresh engine that ran the prompt alone."""
    prompt, params = list(range(5, 25)), SamplingParams(max_tokens=6, ignore_eos=True)
    engine = tiny_engine()
    runner = engine.runner
    engine.add_request(prompt, params, request_id="r")
    # After the first step: on the CPU the buffers made from numpy can alias host memory, which XLA
    # copies rather than donates once.
    first = [t for out in engine.step() for t in out.new_token_ids]
    engine.drain()  # the next batch's launches may still be on the dispatch thread
    logits, samples = runner._free_logits[-1], runner.sampler.last_samples
    addresses = logits.unsafe_buffer_pointer(), samples.unsafe_buffer_pointer()
    tokens = first + drain(engine)["r"][len(first):]
    assert logits.is_deleted() and samples.is_deleted()  # donated to the later steps
    assert len(runner._free_logits) == 1
    assert (runner._free_logits[-1].unsafe_buffer_pointer(), runner.sampler.last_samples.unsafe_buffer_pointer()) \
        == addresses
    fresh = tiny_engine(async_scheduling=False)
    fresh.add_request(prompt, params, request_id="r")
    assert len(tokens) == 6 and tokens == drain(fresh)["r"]


def test_precompiles_warm_run_leaves_one_logits_buffer_for_serving():
    """The warm run of every forward after precompiling writes one buffer in turn and gives it back."""
    runner = tiny_engine(precompile=True).runner
    assert len(runner._free_logits) == 1 and not runner._free_logits[0].is_deleted()


def test_each_bucket_stages_its_inputs_in_one_buffer_that_stays_put():
    """A stage keeps one buffer per bucket for the forward's packed inputs; each run's stage-in takes it
    donated and writes the new batch into it, so it keeps its device address (on GPU a moved buffer
    re-records the forward's CUDA graph, see worker/stage.py) and the forward reads this batch, not a
    stale one."""
    runner = tiny_engine().runner
    stage = runner.stages[0]
    first, second = list(range(5, 45)), list(range(50, 95))  # one bucket: T = S = 64, P = 16 pages of 4
    expected = prompt_logits(runner, first)
    (bucket,) = {key.bucket for key in runner.compilation.compiled_keys if isinstance(key, StageInKey)}
    staged = stage.staged_inputs(bucket)
    address = staged.unsafe_buffer_pointer()
    prompt_logits(runner, second)
    assert staged.is_deleted()  # donated to the second run's stage-in
    staged = stage.staged_inputs(bucket)
    assert staged.unsafe_buffer_pointer() == address
    assert unpack_forward_inputs(np.asarray(staged), *bucket)["token_ids"][:len(second)].tolist() == second
    np.testing.assert_array_equal(prompt_logits(runner, first), expected)


def test_decode_steps_call_the_forward_with_every_buffer_where_it_was():
    """From one decode step to the next, every argument and output of the forward program keeps its
    device address (weights, pages, staged inputs, samples, logits), and the sampling program gets its
    per-row parameters as one array: on GPU, XLA then replays the forward's recorded CUDA graph as it is
    (benchmarks/probes/step_buffers.py measures the same on a GPU)."""
    import jax

    engine = tiny_engine()
    compilation = engine.runner.compilation
    original = compilation.executable
    calls: dict[str, list] = {}

    def addresses(tree):
        return [x.unsafe_buffer_pointer() if isinstance(x, jax.Array) else "host"
                for x in jax.tree_util.tree_leaves(tree)]

    def recording(key):
        executable = original(key)

        def call(*args):
            before = addresses(args)
            out = executable(*args)
            calls.setdefault(type(key).__name__, []).append((before, addresses(out), args))
            return out
        return call

    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3))
    engine.step()  # the prompt; the first decode steps after it still make their buffers
    engine.step()
    engine.drain()  # the batch in flight has its programs (launched on the dispatch thread) before the swap
    compilation.executable = recording  # noqa: a test's seam: what each program is given and gives back
    for _ in range(6):
        engine.step()
    engine.drain()  # the sixth step's batch launched
    forwards = calls["ForwardKey"]
    assert len(forwards) == 6
    assert all(call[:2] == forwards[0][:2] for call in forwards)
    (sampling,) = {len(call[2][1].shape) for call in calls["SampleKey"]}  # the params argument: i32[6, S]
    assert sampling == 2 and all(call[2][1].shape[0] == 6 for call in calls["SampleKey"])
