"""`python -m orca_jax.serve`: flags -> EngineConfig -> Engine -> create_app -> uvicorn.

Flag names follow vLLM's (server/cli_args.py). On SIGTERM or Ctrl-C uvicorn stops accepting
connections; we also tell the engine thread to stop, so in-flight requests end (finish_reason
"abort" after the grace period), their streams close, uploads still coming in get 503, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import signal
import socket
import sys
from types import FrameType

import uvicorn

from orca_jax.server.app import CORSPolicy
from orca_jax.server.cli_args import (PROG, allowed_hosts_from_args, build_parser, engine_config_from_args,
                                      http_limits_from_args, parse_args, read_chat_template,
                                      tool_call_settings_from_args)
from orca_jax.server.lora import parse_lora_modules, register_lora_modules
from orca_jax.worker.kv_pool import XLA_MEM_FRACTION_ENV

__all__ = ["allowed_hosts_from_args", "build_parser", "engine_config_from_args", "main"]
log = logging.getLogger("orca_jax.serve")
# File descriptors beyond the connection cap: the model's files, jax's, the compilation cache's.
SPARE_FILE_DESCRIPTORS = 512


class _Server(uvicorn.Server):
    """uvicorn, plus: a shutdown signal also stops the engine thread, which ends open streams.

    Without that, uvicorn would wait forever for streaming responses to finish on their own.
    """

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            # We are in a signal handler that may have interrupted the loop mid-call; hand the
            # work to the loop rather than take the engine's lock here.
            self._loop.call_soon_threadsafe(self._on_exit)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = engine_config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.gpu_memory_utilization is not None:
        # XLA allocates from its own share of the GPU, fixed when jax starts: make it the budget.
        os.environ.setdefault(XLA_MEM_FRACTION_ENV, str(args.gpu_memory_utilization))
    limits = http_limits_from_args(args)
    raise_open_file_limit(limits.max_connections + SPARE_FILE_DESCRIPTORS)

    # Imported here so `--help` and flag errors come back without loading jax.
    from orca_jax.worker import multihost
    multihost.initialize(config.parallel)  # before anything else touches jax
    from orca_jax.engine import Engine
    from orca_jax.engine.defaults import UsageContext, batch_defaults
    from orca_jax.models.loader import load_model
    from orca_jax.models.weights import WeightsError
    from orca_jax.server import gc_and_gil
    from orca_jax.server.app import create_app
    from orca_jax.server.async_engine import AsyncEngine

    log.info("loading %s", args.model)
    # The engine thread compiles every program once the server is up, so /health can say how far
    # it got; it reports ready only after that, and nothing compiles while serving. Other processes
    # compile as process 0's runner tells them (multihost.Mirror).
    try:
        loaded = load_model(config.model, dtype=config.dtype)
        # The device's and the model's batch (engine/defaults.py) where the flags leave it open.
        config = engine_config_from_args(args, batch_defaults(UsageContext.SERVER, loaded.config.num_params))
        engine = Engine(dataclasses.replace(config, precompile=False), loaded)
    except WeightsError as error:  # a model that cannot be read: one line, not a traceback
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    try:
        register_lora_modules(engine, parse_lora_modules(args.lora_modules))
    except ValueError as error:  # a LoRAError names the adapter and the problem
        log.error("%s", error)
        return 2
    if not multihost.is_leader():
        log.info("process %d: running process 0's steps", args.process_id)
        multihost.run_worker(engine.runner)
        return 0
    for line in startup_report(engine):
        log.info("%s", line)
    url = f"{'https' if args.ssl_certfile else 'http'}://{_url_host(args.host)}:{args.port}"

    def on_ready() -> None:
        gc_and_gil.freeze_startup_heap()
        log.info("ready at %s", url)

    gc_and_gil.shorten_gil_switch_interval()
    async_engine = AsyncEngine(engine, shutdown_grace_seconds=args.shutdown_grace_seconds, precompile=True,
                               on_ready=on_ready)
    cors = None if args.allowed_origins is None else CORSPolicy(
        args.allowed_origins, args.allowed_methods, args.allowed_headers)
    app = create_app(async_engine, api_key=args.api_key or os.environ.get("ORCA_API_KEY"),
                     served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                     metrics_require_auth=args.metrics_require_auth,
                     default_max_tokens=args.default_max_tokens or None,
                     allow_special_tokens_in_text=args.allow_special_tokens_in_text,
                     allowed_hosts=allowed_hosts_from_args(args), chat_template=read_chat_template(args.chat_template),
                     max_upload_bytes=args.max_upload_bytes,
                     log_requests=not args.disable_log_requests, cors=cors,
                     tool_calls=tool_call_settings_from_args(args))
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port,
                                    log_level=args.uvicorn_log_level or args.log_level,
                                    access_log=not args.disable_uvicorn_access_log,
                                    ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                    root_path=args.root_path or "",
                                    timeout_graceful_shutdown=args.shutdown_grace_seconds + 10,
                                    **limits.uvicorn_options())
    # uvicorn re-raises the shutdown signal once it is done, with the handlers it found installed;
    # these make that a no-op, so a graceful SIGTERM (or Ctrl-C) exits 0 instead of dying by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _already_handled)
    _Server(uvicorn_config, on_exit=async_engine.begin_shutdown).run()
    engine.runner.stop_workers()
    return 0


def raise_open_file_limit(wanted: int) -> None:
    """One descriptor per connection: lift the soft limit (often 1024) toward `wanted`, as far as the
    hard limit allows (vLLM does the same)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning("at most %d open files (hard limit): fewer than --max-connections needs", hard)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def startup_report(engine) -> list[str]:
    """What the engine runs on and how big its KV pool is, for the start-up log.

    A GPU machine that silently serves on the CPU (a CPU-only jax) shows up here at once.
    """
    import jax

    devices = [d for stage in engine.runner.stages for d in stage.mesh.devices.flat]
    first = engine.runner.local_device  # only this process's devices answer memory_stats
    line = f"devices: {len(devices)} x {first.device_kind} ({first.platform})"
    stats = first.memory_stats() or {}
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


def _already_handled(sig: int, frame: FrameType | None) -> None:
    log.info("shut down after %s", signal.Signals(sig).name)


if __name__ == "__main__":
    sys.exit(main())
