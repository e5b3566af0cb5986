"""`python -m orca_jax.serve`: flags -> EngineConfig -> Engine -> create_app -> uvicorn.

Flag names follow vLLM's. On SIGTERM or Ctrl-C uvicorn stops accepting connections; we also tell the
engine thread to stop, so in-flight requests end (finish_reason "abort" after the grace period),
their streams close, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn

from orca_jax.config import (AttentionBackend, CacheConfig, EngineConfig, KVAllocation, LoRAConfig, ParallelConfig,
                             SchedulerConfig, SchedulingPolicy)
from orca_jax.server.app import LOCAL_HOSTS
from orca_jax.server.fine_tuning import add_fine_tuning_arguments, fine_tuning_config_from_args
from orca_jax.server.lora import add_lora_arguments, lora_config_from_args, parse_lora_modules, register_lora_modules
from orca_jax.server.serving import DEFAULT_MAX_TOKENS

log = logging.getLogger("orca_jax.serve")
# The server's default, unlike the library's (RESERVE, ORCA as published): chats without max_tokens
# then share the pool instead of running one at a time (measured: benchmarks/results/cpu/kv_modes.json, README).
SERVE_KV_ALLOCATION = KVAllocation.ON_DEMAND


def _default(config_class: type, field_name: str):
    """A config field's default, so flags and library share one source of truth."""
    return next(f.default for f in dataclasses.fields(config_class) if f.name == field_name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m orca_jax.serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset name or Hugging Face GPT-2 directory")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1; $ORCA_API_KEY also works and "
                   "keeps the key out of the process list")
    p.add_argument("--metrics-require-auth", action="store_true", help="put /metrics behind the key too")
    p.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"),
                   help="requests per iteration (ORCA's max batch size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=_default(SchedulerConfig, "max_num_batched_tokens"),
                   help="tokens per iteration; longer prompts are fed over several")
    p.add_argument("--max-waiting", type=int, default=_default(SchedulerConfig, "max_waiting"),
                   help="requests queued beyond the running batch; more get 503 + Retry-After")
    p.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy] + ["deadline"],
                   default=SchedulingPolicy.PRIORITY.value,
                   help="priority lets interactive chat (high 'priority') overtake batch jobs; das is TCB's "
                   "deadline-aware scheduler (requests' deadline_ms); sjf and edf for comparison")
    p.add_argument("--kv-allocation", choices=[k.value for k in KVAllocation], default=SERVE_KV_ALLOCATION.value,
                   help="on_demand: KV pages as requests grow, preempting (and later recomputing) the "
                   "lowest-ranked request when the pool runs dry; reserve: ORCA's up-front reservation of "
                   "prompt + max_tokens, which never preempts but runs requests with a large max_tokens "
                   "few at a time")
    p.add_argument("--priority-preemption", action=argparse.BooleanOptionalAction, default=True,
                   help="under --scheduling-policy priority, a request that does not fit preempts running "
                   "requests it outranks (recomputed later, nothing lost)")
    p.add_argument("--priority-aging-s", type=float, default=_default(SchedulerConfig, "priority_aging_s"),
                   help="seconds of waiting that raise a request's effective priority by 1 (no starvation)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + completion tokens")
    p.add_argument("--page-size", type=int, default=_default(CacheConfig, "page_size"), help="tokens per KV page")
    p.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None, help="KV pool size in GiB")
    p.add_argument("--attention-backend", choices=[b.value for b in AttentionBackend],
                   default=AttentionBackend.AUTO.value)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="override the preset's dtype")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="ORCA inter-layer stages")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ORCA intra-layer split")
    p.add_argument("--coordinator-address", default=None,
                   help="several processes (jax.distributed): process 0's host:port; see README")
    p.add_argument("--num-processes", type=int, default=1, help="controller processes (one per host or GPU)")
    p.add_argument("--process-id", type=int, default=0, help="0 serves HTTP and schedules; others mirror")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache-dir", default="auto",
                   help="JAX's persistent compilation cache, so a second start is fast: 'auto' (a per-user "
                   "directory, $ORCA_JAX_CACHE_DIR or ~/.cache/orca_jax/xla), a path, or 'none' to turn it off")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="plan each iteration only after the previous one's tokens reach the host")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of a chat request that names none, capped by the context left; 0: the "
                   "rest of the context (each such request then reserves KV for all of it)")
    p.add_argument("--allow-special-tokens-in-text", action="store_true",
                   help="let control tokens typed in prompts and messages (e.g. <|im_end|>) act as control "
                   "tokens; only for trusted callers, who can then forge conversation turns")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header values to answer besides localhost's (checked when "
                   "bound to a loopback address, or whenever this is given); '*' turns the check off")
    p.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024)
    p.add_argument("--shutdown-grace-seconds", type=float, default=0.0,
                   help="on SIGTERM, let in-flight requests run this long before aborting them")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_lora_arguments(p)
    add_fine_tuning_arguments(p)
    return p


def allowed_hosts_from_args(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The Host header values to answer, or None for any.

    A loopback server answers only to local names (DNS rebinding); one bound elsewhere answers to
    any unless --allowed-hosts names some.
    """
    extra = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    if "*" in extra:
        return None
    if args.host in ("127.0.0.1", "localhost", "::1") or args.host.startswith("127."):
        return LOCAL_HOSTS + (args.host,) + extra
    return extra or None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError (from the configs' own checks) on inconsistent flags."""
    fine_tuning = fine_tuning_config_from_args(args)
    lora = lora_config_from_args(args)
    if fine_tuning is not None and lora is None:  # fine-tuned adapters are served from the LoRA slots
        lora = LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
    return EngineConfig(
        model=args.model,
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_kv_pages,
                          kv_memory_gib=args.kv_cache_memory_gib),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=SchedulingPolicy(args.scheduling_policy),
                                  max_waiting=args.max_waiting, async_scheduling=args.async_scheduling,
                                  kv_allocation=KVAllocation(args.kv_allocation),
                                  priority_preemption=args.priority_preemption,
                                  priority_aging_s=args.priority_aging_s),
        parallel=ParallelConfig(num_stages=args.pipeline_parallel_size,
                                tensor_parallel=args.tensor_parallel_size,
                                coordinator_address=args.coordinator_address,
                                num_processes=args.num_processes, process_id=args.process_id),
        attention=AttentionBackend(args.attention_backend),
        dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        compilation_cache_dir=None if args.compilation_cache_dir == "none" else args.compilation_cache_dir,
        lora=lora, fine_tuning=fine_tuning)


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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.default_max_tokens < 0:
        parser.error("--default-max-tokens must be 0 (the rest of the context) or more")
    try:
        config = engine_config_from_args(args)
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Imported here so `--help` and flag errors come back without loading jax.
    from orca_jax import multihost
    multihost.initialize(config.parallel)  # before anything else touches jax
    from orca_jax.engine import Engine
    from orca_jax.server import AsyncEngine, create_app, gc_and_gil

    log.info("loading %s", args.model)
    # The engine thread compiles every program once the server is up, so /health can say how far
    # it got; it reports ready only after that, and nothing compiles while serving. Other processes
    # compile as process 0's runner tells them (multihost.Mirror).
    engine = Engine(dataclasses.replace(config, precompile=False))
    try:
        register_lora_modules(engine, lora_modules)
    except ValueError as error:  # a LoRAError names the adapter and the problem
        log.error("%s", error)
        return 2
    if not multihost.is_leader():
        log.info("process %d: running process 0's steps", args.process_id)
        multihost.run_worker(engine.runner)
        return 0
    for line in startup_report(engine):
        log.info("%s", line)
    gc_and_gil.shorten_gil_switch_interval()
    async_engine = AsyncEngine(engine, shutdown_grace_seconds=args.shutdown_grace_seconds, precompile=True,
                               on_ready=gc_and_gil.freeze_startup_heap)
    app = create_app(async_engine, api_key=args.api_key or os.environ.get("ORCA_API_KEY"),
                     served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                     metrics_require_auth=args.metrics_require_auth,
                     default_max_tokens=args.default_max_tokens or None,
                     allow_special_tokens_in_text=args.allow_special_tokens_in_text,
                     allowed_hosts=allowed_hosts_from_args(args), max_upload_bytes=args.max_upload_bytes)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.shutdown_grace_seconds + 10)
    # uvicorn re-raises the shutdown signal once it is done, with the handlers it found installed;
    # these make that a no-op, so a graceful SIGTERM (or Ctrl-C) exits 0 instead of dying by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _already_handled)
    _Server(uvicorn_config, on_exit=async_engine.begin_shutdown).run()
    engine.runner.stop_workers()
    return 0


def startup_report(engine) -> list[str]:
    """What the engine runs on and how big its KV pool is, for the start-up log.

    A GPU machine that silently serves on the CPU (a CPU-only jax) shows up here at once.
    """
    import jax

    devices = [d for stage in engine.runner.stages for d in stage.mesh.devices.flat]
    first = devices[0]
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
    return [line, f"KV pool: {pages} pages x {page_size} tokens = {pages * page_size} tokens for requests "
                  f"(+1 scratch page), {size}"]


def _already_handled(sig: int, frame: FrameType | None) -> None:
    log.info("shut down after %s", signal.Signals(sig).name)


if __name__ == "__main__":
    sys.exit(main())
