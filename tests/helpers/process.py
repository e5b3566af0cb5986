"""Child processes (a server, a CLI, a script on fake devices) that run this checkout: their environment,
a free port, and waiting for a served process to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `python -m orca_jax.serve`'s flags for a tiny server that starts in seconds on a CPU.
TINY_SERVER = ["--model", "tiny-llama", "--page-size", "128", "--num-kv-pages", "8", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "8", "--log-level", "warning"]


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, the caller's entries kept after it (where a
    machine's packages may live: on the GPU machine the carried wheels do), and `extra` set."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Until GET url/health answers 200; fails with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")
