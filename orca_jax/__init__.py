"""orca_jax: ORCA-style iteration-level scheduling and selective batching for LLM serving in JAX."""

from orca_jax.config import (AttentionBackend, CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, SchedulingPolicy)
from orca_jax.lora.request import LoRARequest
from orca_jax.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in jax and the model code; keep `import orca_jax` light for the server's CLI client.
    if name == "LLM":
        from orca_jax.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "ParallelConfig", "AttentionBackend", "SchedulingPolicy", "LoRAConfig", "LoRARequest"]
