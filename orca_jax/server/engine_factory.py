"""The engine `serve` runs, built from its flags: in the server's process, or in the engine core's
(`--engine-process`, where ServedEngineFactory crosses to the spawned child and builds it there)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orca_jax.config import EngineConfig
    from orca_jax.engine import Engine

log = logging.getLogger("orca_jax.serve")


def build_engine(args: argparse.Namespace) -> Engine:
    """Load the model the flags name and build its engine (precompile left to the caller's loop), with
    the device's and the model's batch defaults (engine/defaults.py) where the flags leave it open.
    Raises models.weights.WeightsError for a model that cannot be read."""
    from orca_jax.engine import Engine
    from orca_jax.engine.defaults import UsageContext, batch_defaults
    from orca_jax.models.loader import load_model
    from orca_jax.server.cli_args import engine_config_from_args
    from orca_jax.worker import xla_setup

    config = engine_config_from_args(args)
    xla_setup.prepare(config.parallel)  # XLA reads its options when jax starts
    loaded = load_model(config.model, dtype=config.dtype)
    config = engine_config_from_args(args, batch_defaults(UsageContext.SERVER, loaded.config.num_params))
    return Engine(dataclasses.replace(config, precompile=False), loaded)


@dataclasses.dataclass(frozen=True, slots=True)
class ServedEngineFactory:
    """Picklable: the engine core process calls it to build the engine from serve's command line."""

    argv: tuple[str, ...]
    # A data-parallel replica's CUDA_VISIBLE_DEVICES, set in the core before jax starts its backend.
    visible_devices: str | None = None

    def __call__(self) -> Engine:
        if self.visible_devices is not None:
            import os

            os.environ["CUDA_VISIBLE_DEVICES"] = self.visible_devices
        from orca_jax.server.cli_args import engine_config_from_args, parse_args
        from orca_jax.worker.compilation import configure_compilation_cache

        args = parse_args(list(self.argv))
        # Before the model loads: jax fixes its cache's directory at its first compile.
        configure_compilation_cache(engine_config_from_args(args).compilation_cache_dir)
        engine = build_engine(args)
        from orca_jax.server.lora import parse_lora_modules, register_lora_modules

        register_lora_modules(engine, parse_lora_modules(args.lora_modules))  # a LoRAError ends the start
        for line in startup_report(engine):
            log.info("%s", line)
        return engine


def engine_process_refusal(config: EngineConfig) -> str | None:
    """Why this configuration cannot run with the engine core in its own process (None: it can)."""
    if config.parallel.num_processes != 1:
        return "--engine-process serves from one process; several (--num-processes) need --no-engine-process"
    if config.fine_tuning is not None:
        return ("fine-tuning jobs (--enable-fine-tuning) do not run with the engine core in its own process yet; "
                "start with --no-engine-process")
    return None


def startup_report(engine) -> list[str]:
    """What the engine runs on and how big its KV pool is, for the start-up log.

    A GPU machine that silently serves on the CPU (a CPU-only jax) shows up here at once.
    """
    import jax

    from orca_jax.worker.device_memory import memory_stats

    devices = [d for stage in engine.runner.stages for d in stage.mesh.devices.flat]
    first = engine.runner.local_device  # only this process's devices answer memory_stats
    line = f"devices: {len(devices)} x {first.device_kind} ({first.platform})"
    stats = memory_stats(first)
    if "bytes_limit" in stats:
        line += (f", {stats['bytes_limit'] / 2**30:.1f} GiB each, "
                 f"{stats.get('bytes_in_use', 0) / 2**30:.2f} GiB in use after loading")
    if len(jax.devices()) > len(devices):
        line += f" (of {len(jax.devices())} visible)"
    # Counted as /metrics counts it: the pages requests can hold (page 0 is the scratch page).
    pages, page_size = engine.stats().kv_pages_total, engine.runner.page_size
    kv_bytes = engine.runner.kv_bytes
    size = f"{kv_bytes / 2**30:.2f} GiB" if kv_bytes >= 2**30 else f"{kv_bytes / 2**20:.1f} MiB"
    return [line, f"model: {engine.config.model} in {engine.model_config.dtype}, context {engine.max_model_len} "
                  "tokens",
            f"KV pool: {pages} pages x {page_size} tokens = {pages * page_size} tokens for requests "
            f"(+1 scratch page), {size}"]
