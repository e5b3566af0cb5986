"""Serve flags reach the EngineConfig: vLLM-named parallelism (the LLM arguments: e2e/test_rehearsal_gpt3),
the compilation cache, async scheduling, the dispatch thread and sampling inside the decode forward."""

from orca_jax.config import ParallelConfig
from orca_jax.serve import build_parser, engine_config_from_args


def _parallel(*argv: str) -> ParallelConfig:
    return engine_config_from_args(build_parser().parse_args(list(argv))).parallel


def test_long_and_short_flags_map_to_the_mesh_shape():
    assert _parallel() == ParallelConfig(num_stages=1, tensor_parallel=1)
    assert _parallel("--tensor-parallel-size", "4", "--pipeline-parallel-size", "2") == \
        ParallelConfig(num_stages=2, tensor_parallel=4)
    assert _parallel("-tp", "2", "-pp", "2") == ParallelConfig(num_stages=2, tensor_parallel=2)


def test_serve_flags_for_the_compilation_cache_and_async_scheduling():
    default = engine_config_from_args(build_parser().parse_args([]))
    assert default.compilation_cache_dir == "auto" and default.scheduler.async_scheduling and default.dispatch_thread
    assert default.sampling.fuse_decode_sampling
    off = engine_config_from_args(build_parser().parse_args(
        ["--compilation-cache-dir", "none", "--no-async-scheduling", "--no-dispatch-thread", "--no-fuse-decode-sampling"]))
    assert off.compilation_cache_dir is None and not off.scheduler.async_scheduling and not off.async_scheduling
    assert not off.dispatch_thread and not off.sampling.fuse_decode_sampling
    assert engine_config_from_args(build_parser().parse_args(
        ["--compilation-cache-dir", "/tmp/x"])).compilation_cache_dir == "/tmp/x"
