"""How a serving process ends: its status, without joining the threads still alive.

Interpreter exit (and multiprocessing's, for a spawned process) joins every non-daemon thread, and a
thread-pool thread busy with a fine-tuning job's compile, the KV pool's lending programs or an adapter
read held a SIGTERM'd server for 10-100 s after it had shut down; what such a thread is doing serves
nobody now. Logs and the standard streams are flushed first, so nothing said is lost."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

log = logging.getLogger(__name__)


def exit_now(status: int) -> NoReturn:
    leftovers = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if leftovers:
        log.debug("exiting without joining %s", ", ".join(leftovers))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
