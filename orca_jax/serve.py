"""`python -m orca_jax.serve`: flags -> EngineConfig -> Engine -> create_app -> uvicorn.

Flag names follow vLLM's (server/cli_args.py). The port is bound first, before jax is even imported:
a port in use ends the start in a second with one line, not after the model loaded and every program
compiled. On SIGTERM or Ctrl-C uvicorn stops accepting connections; we also tell the engine thread to
stop, so in-flight requests end (finish_reason "abort" after the grace period), their streams close,
uploads still coming in get 503, and the process exits 0. If the engine loop fails, requests in flight
get its error, /health answers 503, and the process exits 1 within seconds. With --api-server-count N > 1
this process only launches and watches N API server processes and the engine cores
(server/api_servers.py); each API server runs run_api_server.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import resource
import signal
import socket
import sys
from types import FrameType
from typing import NoReturn

import uvicorn

from orca_jax.server.engine_factory import startup_report
from orca_jax.server.process_exit import exit_now

__all__ = ["main", "run"]  # and, lazily, the flag helpers below
log = logging.getLogger("orca_jax.serve")
PROG = "python -m orca_jax.serve"
# File descriptors beyond the connection cap: the model's files, jax's, the compilation cache's.
SPARE_FILE_DESCRIPTORS = 512
LISTEN_BACKLOG = 2048  # uvicorn's default
EXIT_ADDRESS_IN_USE = 2  # as argparse's usage errors: the start cannot proceed as asked
EXIT_ENGINE_FAILED = 1


def __getattr__(name: str):
    # The flag helpers live in server/cli_args.py, which imports jax; they are re-exported lazily so
    # that main() can bind its port before anything heavy is imported.
    if name in ("allowed_hosts_from_args", "build_parser", "engine_config_from_args"):
        from orca_jax.server import cli_args
        return getattr(cli_args, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    def exit_soon(self) -> None:
        """Stop serving, from any thread (uvicorn polls should_exit every 0.1 s)."""
        self.should_exit = True


class _Hooks:
    """What the engine calls back, from its thread or its pipe's reader: once every program is compiled,
    and once it failed. The app and the HTTP server they act on are made after the engine."""

    def __init__(self, url: str, announce: bool = True):
        self.url = url
        self.announce = announce  # the one API server of several that logs "ready at" (once per server)
        self.app = None
        self.server: _Server | None = None

    def on_ready(self) -> None:
        from orca_jax.server import gc_and_gil

        gc_and_gil.freeze_startup_heap()
        self.app.state.preprocess.start()  # the grammar workers, so the first constrained request finds them up
        log.log(logging.INFO if self.announce else logging.DEBUG, "ready at %s", self.url)

    def on_failure(self, error: BaseException) -> None:  # after every request in flight got the error
        log.critical("the engine loop failed (%r); the server exits", error)
        if self.server is not None:
            self.server.exit_soon()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        listener = bind_listener(argv)
    except OSError as error:
        host, port = listen_address(argv)[:2]
        print(f"{PROG}: error: cannot listen on {_url_host(host)}:{port}: {error.strerror or error}",
              file=sys.stderr)
        return EXIT_ADDRESS_IN_USE
    try:
        return _serve(argv, listener)
    finally:
        if listener is not None:
            listener.close()


def _serve(argv: list[str], listener: socket.socket | None) -> int:
    # Imported here, after the port is ours: the flags' module imports jax.
    from orca_jax.worker.kv_pool import XLA_MEM_FRACTION_ENV
    from orca_jax.server.cli_args import engine_config_from_args, http_limits_from_args, parse_args

    args = parse_args(argv)
    config = engine_config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").addFilter(no_tpu_runtime_line)
    if args.gpu_memory_utilization is not None:
        # XLA allocates from its own share of the GPU, fixed when jax starts: make it the budget.
        os.environ.setdefault(XLA_MEM_FRACTION_ENV, str(args.gpu_memory_utilization))
    limits = http_limits_from_args(args)
    raise_open_file_limit(limits.max_connections + SPARE_FILE_DESCRIPTORS)

    import prometheus_client
    prometheus_client.disable_created_metrics()  # the same series whatever --api-server-count is

    if args.data_parallel_size < 1:
        print(f"{PROG}: error: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    from orca_jax.server.api_servers import api_servers_refusal, default_api_server_count
    from orca_jax.worker.xla_setup import gpu_expected
    # A combination several API servers cannot serve keeps one unless the flag asks (then refused below).
    api_server_count = args.api_server_count or (1 if api_servers_refusal(config) else default_api_server_count(
        args.data_parallel_size, gpu=gpu_expected() and args.engine_process is not False))
    if api_server_count > 1:
        return _api_servers(argv, args, config, listener, api_server_count)
    hooks = _Hooks(_url(args))
    if args.engine_process or args.data_parallel_size > 1:
        async_engine = _engine_process(argv, args, config, hooks.on_ready, hooks.on_failure)
        if isinstance(async_engine, int):
            return async_engine
        stop_workers = None
    else:
        async_engine = _engine_thread(args, config, hooks.on_ready, hooks.on_failure)
        if isinstance(async_engine, int):
            return async_engine
        stop_workers = async_engine.engine.runner.stop_workers
    status = _run_http(args, async_engine, listener, hooks)
    if stop_workers is not None:
        stop_workers()
    return status


def _url(args) -> str:
    return f"{'https' if args.ssl_certfile else 'http'}://{_url_host(args.host)}:{args.port}"


def _run_http(args, async_engine, listener: socket.socket | None, hooks: _Hooks, shared_metrics=None) -> int:
    """Serve the app over `async_engine` until a signal or the engine's failure; the exit status."""
    from orca_jax.server.app import CORSPolicy, create_app
    from orca_jax.server.cli_args import (allowed_hosts_from_args, http_limits_from_args, read_chat_template,
                                          tool_call_settings_from_args)
    from orca_jax.server.preprocess import frontend_limits_from_args

    limits = http_limits_from_args(args)
    cors = None if args.allowed_origins is None else CORSPolicy(
        args.allowed_origins, args.allowed_methods, args.allowed_headers)
    app = create_app(async_engine, api_key=args.api_key or os.environ.get("ORCA_API_KEY"),
                     served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                     metrics_require_auth=args.metrics_require_auth,
                     default_max_tokens=args.default_max_tokens or None,
                     allow_special_tokens_in_text=args.allow_special_tokens_in_text,
                     allowed_hosts=allowed_hosts_from_args(args), chat_template=read_chat_template(args.chat_template),
                     max_upload_bytes=args.max_upload_bytes, max_json_depth=args.max_json_depth,
                     log_requests=not args.disable_log_requests, cors=cors,
                     tool_calls=tool_call_settings_from_args(args), frontend=frontend_limits_from_args(args),
                     shared_metrics=shared_metrics)
    hooks.app = app
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
    hooks.server = server = _Server(uvicorn_config, on_exit=async_engine.begin_shutdown)
    server.run(sockets=None if listener is None else [listener])
    if async_engine.error is not None:
        log.error("exiting with status %d: the engine loop failed", EXIT_ENGINE_FAILED)
        return EXIT_ENGINE_FAILED
    return 0


def _api_servers(argv, args, config, listener, count: int) -> int:
    """--api-server-count N > 1: this process launches the engine cores and N API server processes
    (run_api_server), and watches them until they have all exited."""
    from orca_jax.engine.replicas import replica_device_slices
    from orca_jax.server.api_servers import ApiServers, api_servers_refusal
    from orca_jax.server.engine_factory import ServedEngineFactory

    refusal = api_servers_refusal(config)
    if refusal is not None:
        print(f"{PROG}: error: {refusal}", file=sys.stderr)
        return 2
    try:
        slices = ([None] if args.data_parallel_size == 1
                  else replica_device_slices(config.parallel, args.data_parallel_size))
    except ValueError as error:  # too few GPUs for the replicas
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    log.info("loading %s in %d engine core process(es), served by %d API server processes", args.model,
             len(slices), count)
    servers = ApiServers([ServedEngineFactory(tuple(argv), s) for s in slices], count, run_api_server, listener,
                         argv=argv, log_level=args.log_level, grace_seconds=args.shutdown_grace_seconds)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: servers.stop())
    return servers.wait()


def run_api_server(context) -> int:
    """One API server process of several (server/api_servers.py's front end): serve's HTTP over the
    engine cores the launcher started, on its listening socket; the exit status."""
    from orca_jax.engine.core_client import EngineStartError
    from orca_jax.server.api_servers import connect_engine
    from orca_jax.server.cli_args import parse_args

    args = parse_args(list(context.argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api server {context.index}]: %(message)s")
    import prometheus_client
    prometheus_client.disable_created_metrics()
    hooks = _Hooks(_url(args), announce=context.index == 0)
    arrays = context.arrays()
    try:
        async_engine = connect_engine(context, arrays, shutdown_grace_seconds=args.shutdown_grace_seconds,
                                      on_ready=hooks.on_ready, on_failure=hooks.on_failure)
    except EngineStartError as error:  # a model the cores cannot read: one line, from one API server
        if context.index == 0:
            print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return _run_http(args, async_engine, context.listener, hooks, context.shared_metrics(arrays))


def _engine_thread(args, config, on_ready, on_failure):
    """The engine on a thread of this process (AsyncEngine); an exit status where the start ends here."""
    # Imported here so `--help` and flag errors come back without loading jax.
    from orca_jax.worker import multihost
    from orca_jax.worker.compilation import configure_compilation_cache
    from orca_jax.worker import xla_setup
    xla_setup.prepare(config.parallel)  # XLA reads its options when jax starts
    multihost.initialize(config.parallel)  # before anything else touches jax
    # Before the model loads: jax fixes its cache's directory at its first compile.
    configure_compilation_cache(config.compilation_cache_dir)
    from orca_jax.models.weights import WeightsError
    from orca_jax.server import gc_and_gil
    from orca_jax.server.async_engine import AsyncEngine
    from orca_jax.server.engine_factory import build_engine
    from orca_jax.server.lora import parse_lora_modules, register_lora_modules

    log.info("loading %s", args.model)
    # The engine thread compiles every program once the server is up, so /health can say how far
    # it got; it reports ready only after that, and nothing compiles while serving. Other processes
    # compile as process 0's runner tells them (multihost.Mirror).
    try:
        engine = build_engine(args)
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
    gc_and_gil.shorten_gil_switch_interval()
    return AsyncEngine(engine, shutdown_grace_seconds=args.shutdown_grace_seconds, precompile=True,
                       on_ready=on_ready, on_failure=on_failure)


def _engine_process(argv, args, config, on_ready, on_failure):
    """The engine core in a spawned child process (ProcessEngine), built there from the same flags;
    an exit status where the start ends here. This process never starts jax."""
    from orca_jax.server.engine_factory import ServedEngineFactory, engine_process_refusal
    from orca_jax.engine.core_client import EngineStartError
    from orca_jax.server.process_engine import ProcessEngine

    refusal = engine_process_refusal(config)
    if refusal is not None:
        print(f"{PROG}: error: {refusal}", file=sys.stderr)
        return 2
    replicas = args.data_parallel_size
    log.info("loading %s in %s", args.model, "the engine core process" if replicas == 1
             else f"{replicas} engine core processes (data parallel)")

    def replica(visible_devices: str | None) -> ProcessEngine:
        return ProcessEngine(ServedEngineFactory(tuple(argv), visible_devices),
                             shutdown_grace_seconds=args.shutdown_grace_seconds, precompile=True,
                             on_ready=on_ready, on_failure=on_failure, log_level=args.log_level)

    try:
        if replicas == 1:
            return replica(None)
        from orca_jax.engine.replicas import replica_device_slices
        from orca_jax.server.data_parallel import DataParallelEngine, start_replicas

        slices = replica_device_slices(config.parallel, replicas)
        return DataParallelEngine(start_replicas([functools.partial(replica, s) for s in slices]),
                                  on_ready=on_ready, on_failure=on_failure)
    except (EngineStartError, ValueError) as error:  # a model that cannot be read, too few GPUs: one line
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def listen_address(argv: list[str]) -> tuple[str, int, int]:
    """(--host, --port, --process-id) as the full parser will read them (a --config file under the
    command line), read without it: that parser's module imports jax."""
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config", default=None)
    finder.add_argument("--host", default=None)
    finder.add_argument("--port", default=None)
    finder.add_argument("--process-id", default=None)
    found, _ = finder.parse_known_args(argv)
    settings = {}
    if found.config is not None:
        import yaml

        try:
            with open(found.config, encoding="utf-8") as f:
                settings = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            settings = {}  # the full parser reports it
        settings = settings if isinstance(settings, dict) else {}

    def value(name: str, default):
        given = getattr(found, name.replace("-", "_"))
        if given is not None:
            return given
        return settings.get(name, settings.get(name.replace("-", "_"), default))

    try:
        return str(value("host", "127.0.0.1")), int(value("port", 8000)), int(value("process-id", 0))
    except (TypeError, ValueError):
        return "127.0.0.1", -1, 0  # not numbers: the full parser reports them


def bind_listener(argv: list[str]) -> socket.socket | None:
    """The listening socket of the address the flags name, bound now (OSError when it cannot be);
    None where nothing is to be bound here: --help, flags the full parser will refuse, or a process
    other than process 0 (which serves no HTTP)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return None
    host, port, process_id = listen_address(argv)
    if process_id != 0 or not 0 <= port < 2**16:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse TIME_WAIT ports
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def no_tpu_runtime_line(record: logging.LogRecord) -> bool:
    """A logging filter for jax's backend probe: drops the INFO line every start on a machine without
    a TPU runtime logs ("Unable to initialize backend 'tpu': ... libtpu.so ..."), and nothing else.
    Filtered rather than avoided with JAX_PLATFORMS, which would have to name the platforms a
    machine has (a GPU one must still find its GPU)."""
    message = record.getMessage()
    return not (message.startswith("Unable to initialize backend 'tpu'") and "libtpu" in message)


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


def _already_handled(sig: int, frame: FrameType | None) -> None:
    log.info("shut down after %s", signal.Signals(sig).name)


def run() -> NoReturn:
    """The command line's entry (`python -m orca_jax.serve`, `orca-serve`): main(), then the process
    ends without joining the threads still alive (server/process_exit.py says why)."""
    exit_now(main())

if __name__ == "__main__":
    run()
