"""The compilation caches never fail a start: an entry that is damaged, cut short or another program's
is dropped, compiled again and replaced; processes share a directory safely (jax's entries under a
file lock, ours written whole and renamed into place); two servers on one fresh directory both
start and serve, and so does a third after every entry was damaged."""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import pytest
from jax._src import compilation_cache  # reset_cache: no public way to reopen it

from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.compilation import (JAX_CACHE_MAX_BYTES, JAX_SUBDIR, compile_noting_jax_cache,
                                         configure_compilation_cache)
from orca_jax.worker.executable_cache import ExecutableCache

from tests.helpers.engines import drain, tiny_engine
from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy


@pytest.fixture
def jax_cache_settings():
    """jax's process-wide cache settings, put back after the test."""
    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size")
    before = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in before.items():
        jax.config.update(name, value)


@pytest.fixture
def own_jax_cache(tmp_path):
    """jax's persistent cache on, in a directory of the test's own, reopened there; the process's
    settings and cache are put back afterwards. The session's may be off by now (an engine with no
    cache turns it off for the process) or hold entries other processes wrote."""
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_compilation_cache_max_size")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


# Lowered for a shape, not an array: building an array inside `lower` would run (and maybe load from
# jax's cache) a program of its own, which compile_noting_jax_cache would count as the one it compiles.
VECTOR = jax.ShapeDtypeStruct((4,), jax.numpy.float32)


def _fresh_program(offset: float):
    """A program jax's session cache cannot hold yet (its constant is new), compiled now."""
    compiled, from_jax_cache = compile_noting_jax_cache(
        lambda: jax.jit(lambda x: x * 3 + offset).lower(VECTOR), None)
    assert not from_jax_cache
    return compiled


def test_an_executable_jax_s_cache_served_is_noticed(own_jax_cache):
    offset = random.random()
    lower = lambda: jax.jit(lambda x: x - offset).lower(VECTOR)  # noqa: E731
    assert compile_noting_jax_cache(lower, None)[1] is False
    # jax's cache holds it now. On the CPU such an executable serializes without its kernels
    # (its reload fails to run with NOT_FOUND), so the engine stores only fresh compiles in its cache.
    assert compile_noting_jax_cache(lower, None)[1] is True


@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "another program's", "old format"])
def test_a_damaged_entry_is_never_loaded_and_is_removed(tmp_path, damage):
    cache = ExecutableCache(str(tmp_path))
    offset = random.random()
    cache.store("a", _fresh_program(offset))
    cache.store("b", _fresh_program(offset + 1))
    path = tmp_path / "a.bin"
    entry = path.read_bytes()
    if damage == "flipped byte":
        path.write_bytes(entry[:-100] + bytes([entry[-100] ^ 1]) + entry[-99:])
    elif damage == "cut short":
        path.write_bytes(entry[: len(entry) // 2])
    elif damage == "another program's":
        shutil.copyfile(tmp_path / "b.bin", path)
    else:  # what this cache wrote before its entries carried their fingerprint and digest
        path.write_bytes(entry[entry.index(b"\x80"):])
    devices = jax.devices()[:1]
    assert cache.load("a", devices) is None and not path.exists()
    cache.store("a", _fresh_program(offset + 2))  # what the compile that follows a miss does: the entry is replaced
    assert cache.load("a", devices)(jax.numpy.ones(4)).tolist() == pytest.approx([3.0 + offset + 2] * 4)


def test_an_engine_recompiles_and_replaces_entries_planted_over_others(tmp_path, jax_cache_settings):
    def engine():
        # A batch shape no other test compiles: jax's session cache must not hold these programs (an
        # executable it served is not stored in ours, see test_an_executable_jax_s_cache_served_is_noticed).
        return tiny_engine(max_num_seqs=7, max_num_batched_tokens=24, num_pages=43, precompile=True,
                           compilation_cache_dir=str(tmp_path))

    def generate(e):
        e.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), request_id="r")
        return drain(e)["r"]

    first = engine()
    expected = generate(first)
    entries = sorted(glob.glob(str(tmp_path / "executables" / "*.bin")))
    assert len(entries) == first.runner.compilation.num_compiled_programs > 2
    shutil.copyfile(entries[0], entries[1])  # one program's executable under another's name
    with open(entries[2], "r+b") as f:  # and one cut short
        f.truncate(100)
    second = engine()
    cache = second.runner.compilation.executable_cache
    assert cache.misses == 2 and cache.hits == len(entries) - 2
    assert generate(second) == expected
    third = engine()  # both entries were replaced
    assert third.runner.compilation.executable_cache.misses == 0


def test_a_directory_of_ours_gets_jax_entries_under_its_lock(tmp_path, jax_cache_settings):
    assert configure_compilation_cache(str(tmp_path)) == str(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / JAX_SUBDIR)
    assert jax.config.jax_compilation_cache_max_size == JAX_CACHE_MAX_BYTES  # jax locks its directory then


def test_the_engine_s_programs_are_written_to_its_cache_only(tmp_path, own_jax_cache):
    # jax's cache in tmp_path itself; the engine's directory beside it. Two threads compiling the
    # same engine programs into both caches waited on jax's lock (see not_written_to_jax_cache).
    configure_compilation_cache(str(tmp_path / "ours"))
    engine = tiny_engine(max_num_seqs=5, max_num_batched_tokens=28, num_pages=41, precompile=True,
                         compilation_cache_dir=str(tmp_path / "ours"))
    stored = glob.glob(str(tmp_path / "ours" / "executables" / "*.bin"))
    assert len(stored) == engine.runner.compilation.num_compiled_programs > 2
    jax_entries = [os.path.basename(p) for p in glob.glob(str(tmp_path / "ours" / JAX_SUBDIR / "*"))]
    assert not [name for name in jax_entries if "stage_forward" in name or "sample" in name], jax_entries
    # while other programs on the thread that built it still go to jax's cache
    _fresh_program(random.random())
    assert any(name.startswith("jit__lambda") for name in os.listdir(tmp_path / "ours" / JAX_SUBDIR))


def _start(cache_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = checkout_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's: these servers use the directory they are given
    process = OutputDrained([sys.executable, "-m", "orca_jax.serve", "--port", str(port), *TINY_SERVER,
                             "--compilation-cache-dir", str(cache_dir)], cwd=ROOT, env=env)
    return process, f"http://127.0.0.1:{port}"


def _serves(url: str) -> bool:
    answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}, timeout=60)
    return answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) > 0


def _stop(process: subprocess.Popen) -> str:
    process.terminate()
    try:
        return process.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[0]


def test_servers_sharing_a_cache_directory_start_and_serve_whatever_it_holds(tmp_path):
    cache_dir = tmp_path / "cache"
    servers = [_start(cache_dir), _start(cache_dir)]  # two at once, on an empty directory
    try:
        for process, url in servers:
            wait_healthy(url, process, timeout=300)
        assert all(_serves(url) for _, url in servers)
    finally:
        outputs = [_stop(process) for process, _ in servers]
    assert all("Traceback" not in output for output in outputs), outputs
    ours = glob.glob(str(cache_dir / "executables" / "*.bin"))
    theirs = [p for p in glob.glob(str(cache_dir / JAX_SUBDIR / "*-cache"))]
    assert ours and theirs
    # A code change gives every program a new fingerprint: our entries miss while jax's still hit. A
    # start then ran programs jax's cache served and stored them in ours, without their kernels, and
    # the start after it died in its precompile with "NOT_FOUND: Function ... not found".
    shutil.rmtree(cache_dir / "executables")
    for damaged in (False, True):
        if damaged:  # and every jax entry cut short, as by a process killed mid-write: each is compiled afresh
            # (jax's entries are zstd frames without a checksum: bytes changed in the middle of one can go
            # unnoticed and crash the start, SIGILL on the CPU; under jax's lock an entry is only ever cut
            # short, which zstd does notice. Our own entries carry a sha256: see the test above.)
            for path in theirs:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
        process, url = _start(cache_dir)
        try:
            wait_healthy(url, process, timeout=300)
            assert _serves(url)
        finally:
            output = _stop(process)
        assert "Traceback" not in output and "NOT_FOUND" not in output, output
