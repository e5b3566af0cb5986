"""Compiled programs reloaded from disk without tracing (worker/executable_cache.py): a second start loads
every program, runs them to the same tokens, and never loads a program built for something else."""

import glob
import os
import pickle

import jax
import pytest
from jax._src import compilation_cache  # reset_cache: no public way to reopen it
from jax.experimental import serialize_executable

from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import Bucket, ForwardKey, key_from_json, key_to_json
from orca_jax.worker.executable_cache import ExecutableCache

from tests.helpers.engines import drain, tiny_engine

PROMPTS = [[5, 6, 7], [9] * 11, list(range(3, 40))]


@pytest.fixture
def cache_dir(tmp_path):
    """A cache directory of the test's own; jax's session-wide setting is put back afterwards.

    jax keeps what it compiled in memory and opens its persistent cache once per process: both are
    cleared here, so the test's engines compile into their own directory, and the persistent cache is
    reopened afterwards on the session's. Otherwise a program another test of this process compiled
    comes from jax's caches, and on CPU such an executable cannot be serialized again: the counts
    below would depend on which tests ran first."""
    before = jax.config.jax_compilation_cache_dir
    jax.clear_caches()
    compilation_cache.reset_cache()
    yield str(tmp_path)
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def generate(engine) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
           for p in PROMPTS]
    done = drain(engine)
    return [done[i] for i in ids]


# tiny_engine's arguments: every program precompiled, through the executable cache.
PRECOMPILED = dict(max_num_seqs=4, max_num_batched_tokens=32, precompile=True)


def test_a_second_start_loads_every_program_and_generates_the_same_tokens(cache_dir):
    first = tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED)
    cache = first.runner.compilation.executable_cache
    assert cache.hits == 0 and cache.misses == first.runner.compilation.num_compiled_programs > 0
    expected = generate(first)
    second = tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED)
    assert second.runner.compilation.executable_cache.hits == second.runner.compilation.num_compiled_programs == cache.misses
    assert second.runner.compilation.executable_cache.misses == 0
    assert generate(second) == expected == generate(
        tiny_engine(compilation_cache_dir=None, **PRECOMPILED))  # None: no cache at all


def test_a_different_pool_or_model_compiles_its_own_programs(cache_dir):
    tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED)
    # The KV inputs' shapes differ:
    other_pool = tiny_engine(num_pages=200, compilation_cache_dir=cache_dir, **PRECOMPILED)
    programs = other_pool.runner.compilation.compiled_keys
    num_forward = sum(isinstance(key, ForwardKey) for key in programs)
    # Sampling sees only [S, vocab] logits and a stage-in only its bucket's packed inputs, the same for
    # both pools: those are rightly shared.
    assert other_pool.runner.compilation.executable_cache.misses == num_forward > 0
    assert other_pool.runner.compilation.executable_cache.hits == len(programs) - num_forward
    other_model = tiny_engine("tiny-gpt", compilation_cache_dir=cache_dir, **PRECOMPILED)  # programs name their model
    assert other_model.runner.compilation.executable_cache.hits == 0


def test_an_unreadable_entry_is_dropped_and_compiled_again(cache_dir):
    expected = generate(tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED))
    files = sorted(glob.glob(os.path.join(cache_dir, "executables", "*.bin")))
    with open(files[0], "wb") as f:
        f.write(b"not an executable")
    again = tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED)
    assert again.runner.compilation.executable_cache.misses == 1
    assert again.runner.compilation.executable_cache.hits == again.runner.compilation.num_compiled_programs - 1
    assert generate(again) == expected


def test_the_cache_keeps_to_its_size_by_dropping_the_least_recently_used(tmp_path):
    compiled = jax.jit(lambda x: x * 2).lower(jax.numpy.zeros(4)).compile()
    size = len(pickle.dumps(serialize_executable.serialize(compiled)))
    cache = ExecutableCache(str(tmp_path), max_bytes=int(2.5 * size))  # room for two
    device = jax.devices()[:1]
    for name in ("a", "b"):
        cache.store(name, compiled)
    os.utime(os.path.join(tmp_path, "a.bin"), (1, 1))  # "a" is the oldest ...
    os.utime(os.path.join(tmp_path, "b.bin"), (2, 2))
    assert cache.load("a", device) is not None  # ... until it is used
    cache.store("c", compiled)
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "c.bin"]
    assert cache.load("a", device)(jax.numpy.ones(4)).tolist() == [2.0] * 4


def test_nothing_is_stored_once_the_code_on_disk_is_not_the_code_running(cache_dir, monkeypatch):
    # A file saved while an engine starts must not label the old code's programs with the new digest.
    from orca_jax.worker import executable_cache

    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited since import")
    engine = tiny_engine(compilation_cache_dir=cache_dir, **PRECOMPILED)
    assert not engine.runner.compilation.executable_cache.enabled
    assert not glob.glob(os.path.join(cache_dir, "executables", "*.bin"))


def test_a_directory_others_can_write_to_is_not_read(tmp_path):
    # Entries are unpickled, so a group- or world-writable directory could hand this process code.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not ExecutableCache(str(shared)).enabled
    assert ExecutableCache(str(tmp_path / "own")).enabled


def test_a_disk_that_refuses_writes_costs_only_the_cache(tmp_path, monkeypatch):
    cache = ExecutableCache(str(tmp_path))
    compiled = jax.jit(lambda x: x + 1).lower(jax.numpy.zeros(2)).compile()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", full_disk)
    cache.store("a", compiled)  # logs a warning, raises nothing
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("setting", ["jax_threefry_partitionable", "jax_default_matmul_precision"])
def test_a_jax_setting_that_changes_the_program_changes_the_fingerprint(setting):
    before = getattr(jax.config, setting)
    # conftest sets the precision to "highest" for the suite: any other value is a change
    changed = (not before) if isinstance(before, bool) else next(v for v in ("highest", "high") if v != before)
    key = ExecutableCache.fingerprint("a program")
    try:
        jax.config.update(setting, changed)
        assert ExecutableCache.fingerprint("a program") != key
    finally:
        jax.config.update(setting, before)
    assert ExecutableCache.fingerprint("a program") == key  # and nothing else moved


def test_a_permissive_umask_still_makes_a_private_directory(tmp_path):
    old = os.umask(0o002)  # group-writable by default, as on many desktops
    try:
        assert ExecutableCache(str(tmp_path / "fresh")).enabled
    finally:
        os.umask(old)
    assert (tmp_path / "fresh").stat().st_mode & 0o077 == 0


def test_forward_keys_travel_as_json_with_their_decode_flag():
    for key in (ForwardKey(Bucket(8, 8, 16), 0), ForwardKey(Bucket(8, 8, 16), 1, lora=True, decode=True)):
        assert key_from_json(key_to_json(key)) == key
