"""What the server's modules need of an engine: the seam between HTTP and where the engine runs.

Two implementations: AsyncEngine (server/async_engine.py: the engine on a thread of this process) and
ProcessEngine (server/process_engine.py: the engine core in a child process, `--engine-process`); and
one over several engines, DataParallelEngine (server/data_parallel.py), a ReplicatedEngineClient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from orca_jax.engine import EngineStats
    from orca_jax.lora.request import LoRARequest
    from orca_jax.sampling_params import SamplingParams
    from orca_jax.server.async_engine import Readiness
    from orca_jax.server.request_stream import RequestStream
    from orca_jax.structured.matcher import CompiledGrammar


@runtime_checkable
class EngineClient(Protocol):
    """An engine driven from the event loop: requests in as RequestStreams, state for /health and /metrics.

    `engine` is the engine's fixed parts (config, model_config, max_model_len, tokenizer,
    grammar_compiler, lora, fine_tuning, list_loras): the Engine itself in-thread, a view in a process.
    Fine-tuning's routes need AsyncEngine.run_in_engine (the engine in this process).
    """

    engine: object
    readiness: Readiness
    error: BaseException | None
    latest_stats: EngineStats
    max_in_flight: int

    def start(self) -> None: ...

    def begin_shutdown(self) -> None: ...

    def shutdown(self, timeout: float | None = None) -> None: ...

    def add_iteration_listener(self, listener: Callable[[EngineStats], None]) -> None: ...

    def add_lora_listener(self, listener: Callable[[list[LoRARequest]], None]) -> None:
        """Call `listener(adapters)` on the event loop with the engine's registered adapters whenever
        another front end loaded or unloaded one (engines driven by several API server processes)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, *, request_id: str,
                     priority: int = 0, deadline: float | None = None, lora_request: LoRARequest | None = None,
                     grammar: CompiledGrammar | None = None) -> RequestStream: ...

    async def reset_prefix_cache(self) -> int: ...

    async def add_lora(self, lora_request: LoRARequest, adapter: object) -> None: ...

    async def remove_lora(self, lora_int_id: int) -> bool: ...


@runtime_checkable
class ReplicatedEngineClient(EngineClient, Protocol):
    """An EngineClient over several engines (data-parallel replicas): latest_stats is all of them as
    one (EngineStats.summed), and /metrics shows each one's too."""

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's latest stats, in replica order."""
