"""server/process_exit.py: a serving process ends with its status while a thread it started still
runs, and what it printed or logged before is not lost."""

import subprocess
import sys

from tests.helpers.process import ROOT, checkout_env

CHILD = """
import logging, sys, threading
from orca_jax.server.process_exit import exit_now
logging.basicConfig(level="INFO", stream=sys.stderr, format="%(message)s")
never = threading.Event()
threading.Thread(target=never.wait, name="busy-compiling").start()  # not daemonic: exit would join it
print("said before the exit", end="")
logging.getLogger("child").info("logged before the exit")
exit_now(3)
"""


def test_exit_now_ends_with_its_status_beside_a_running_thread_and_flushes_first():
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=checkout_env(), capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 3, child.stderr
    assert child.stdout == "said before the exit"
    assert "logged before the exit" in child.stderr
