"""Run a script on N fake CPU devices in a fresh process (the device count is fixed at jax's start)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.process import ROOT, checkout_env


def fake_device_env(num_devices: int) -> dict[str, str]:
    """The environment of a child process that sees num_devices CPU devices and this checkout's code."""
    return checkout_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}", JAX_PLATFORMS="cpu")


def run_on_fake_devices(num_devices: int, *argv: str, timeout: float = 600):
    """Run `python argv...` (e.g. "-c", SCRIPT, ARG) from the repository root; returns the JSON its
    last output line prints."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=fake_device_env(num_devices),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
