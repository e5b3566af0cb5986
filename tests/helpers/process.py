"""Child processes (a server, a CLI, a script on fake devices) that run this checkout: their environment,
a free port, and waiting for a served process to answer."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
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


class OutputDrained(subprocess.Popen):
    """A child whose stdout and stderr (merged, as text) a thread reads as they come, so a chatty child
    never stops on a full pipe while the test is busy elsewhere (a server logging every request does,
    after ~64 KiB). readline() gives the lines in order ("" once the output has ended); communicate()
    waits for the exit and returns what readline() has not given."""

    def __init__(self, command, **kwargs):
        super().__init__(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._ended = False
        self._reader = threading.Thread(target=self._drain, name="test-output-drain", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def readline(self, timeout: float | None = None) -> str:
        """The next line, waiting at most `timeout` seconds (queue.Empty past it); "" at the end."""
        if self._ended:
            return ""
        line = self._lines.get(timeout=timeout)
        self._ended = line is None
        return line or ""

    def communicate(self, input=None, timeout=None):
        assert input is None, "the child's stdin is not a pipe"
        self.wait(timeout)
        # A grandchild that inherited the pipe can hold it open after the child is gone: read what came.
        self._reader.join(timeout=10)
        rest = []
        while not self._ended:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            self._ended = line is None
            rest.append(line or "")
        return "".join(rest), None
