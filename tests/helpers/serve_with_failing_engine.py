"""`python -m orca_jax.serve` whose engine loop raises once it holds the test's two requests (or one,
after a few seconds): what a test of the server's reaction to a dead engine runs as a process. Both
requests are in before the loop fails, so each gets the error rather than a refused connection from
a process that already exited (a race a busy machine loses)."""

import sys
import time

from orca_jax.engine.core import Engine
from orca_jax.serve import main

WAIT_FOR_SECOND_REQUEST_S = 10.0


def _failing_step(self):
    requests = self.scheduler.requests
    if not requests:
        return []
    first_arrival = min(request.arrival_time for request in requests)
    if len(requests) >= 2 or time.monotonic() - first_arrival > WAIT_FOR_SECOND_REQUEST_S:
        raise RuntimeError("the engine step failed on purpose (a test)")
    return []  # the loop backs off while a step returns nothing


if __name__ == "__main__":
    Engine.step = _failing_step
    sys.exit(main())
