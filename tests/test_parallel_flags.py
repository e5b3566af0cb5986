"""vLLM-named parallelism flags reach the engine's ParallelConfig (the LLM arguments: test_rehearsal_gpt3)."""

from orca_jax.config import ParallelConfig
from orca_jax.serve import build_parser, engine_config_from_args


def _parallel(*argv: str) -> ParallelConfig:
    return engine_config_from_args(build_parser().parse_args(list(argv))).parallel


def test_long_and_short_flags_map_to_the_mesh_shape():
    assert _parallel() == ParallelConfig(num_stages=1, tensor_parallel=1)
    assert _parallel("--tensor-parallel-size", "4", "--pipeline-parallel-size", "2") == \
        ParallelConfig(num_stages=2, tensor_parallel=4)
    assert _parallel("-tp", "2", "-pp", "2") == ParallelConfig(num_stages=2, tensor_parallel=2)
