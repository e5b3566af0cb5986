"""An app served by uvicorn on a free loopback port, in a background thread (benchmarks and tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn

from orca_jax.server.http_limits import HTTPLimits


@dataclasses.dataclass(frozen=True, slots=True)
class ServedApp:
    url: str  # http://127.0.0.1:PORT
    server: uvicorn.Server
    thread: threading.Thread  # the event loop's


@contextlib.contextmanager
def served_in_thread(app, *, wrap_run: Callable | None = None, **config) -> Iterator[ServedApp]:
    """Serve `app` until the block ends. `config`: uvicorn.Config's options (log level warning and
    serve's default HTTP limits unless given); `wrap_run(server.run, sockets=...)` runs the server
    instead, e.g. a profiler's runcall."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **HTTPLimits().uvicorn_options(),
                                                   **config}))
    run = server.run if wrap_run is None else (lambda **kwargs: wrap_run(server.run, **kwargs))
    thread = threading.Thread(target=run, kwargs={"sockets": [sock]}, name="event-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield ServedApp(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
