"""The environment of a child process (a server, a CLI, a script on fake devices) that runs this checkout."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, the caller's entries kept after it (where a
    machine's packages may live: on the GPU machine the carried wheels do), and `extra` set."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
