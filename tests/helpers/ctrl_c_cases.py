"""The chat client's Ctrl-C cases, each run in a process of its own (by server/test_client.py):
`python tests/helpers/ctrl_c_cases.py CASE` prints what it saw as one JSON line.

A SIGINT raised inside the test process would reach pytest itself wherever the handler under test
is not installed, and a suite started in the background (`make test &`) inherits SIGINT ignored, so
the handler is never installed there: the parent starts this process with SIGINT's default action
back, as a terminal's foreground process has it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

from orca_jax import client
from orca_jax.server.app import create_app

from tests.helpers.server import FakeEngine, live_server

ABORT_WAIT_S = 60.0  # the server notices the closed stream within an iteration or two; this bounds a hang


def reply_or_interrupt() -> dict:
    """Ctrl-C during a reply cancels that reply (its `async with` closes the stream); the session goes on."""
    cancelled = []

    async def endless_reply():
        try:
            asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def quick_reply():
        return "done"

    with asyncio.Runner() as runner:
        first = client.reply_or_interrupt(runner, endless_reply())
        second = client.reply_or_interrupt(runner, quick_reply())
    return {"first": first, "cancelled": cancelled, "second": second}


def chat() -> dict:
    """Ctrl-C once the first reply has shown 3 letters, then one more turn: what was written, the
    prompts the server got, and how many requests it saw aborted."""
    engine = FakeEngine(max_model_len=512, num_pages=1024, step_seconds=0.02)
    with live_server(create_app(engine)) as server:
        lines = iter(["hello", "go on", "/exit"])
        written: list[str] = []

        def write(text: str) -> None:
            written.append(text)
            if len("".join(written).split("assistant> ")[-1]) == 3 and len(engine.prompts) == 1:
                signal.raise_signal(signal.SIGINT)

        args = client.build_parser().parse_args(["--url", server.url, "chat", "--max-tokens", "40"])
        with asyncio.Runner() as runner:
            http = client._http_client(args)
            client.run_chat(runner, client.Client(http, None), args, read_line=lambda prompt: next(lines),
                            write=write)
            runner.run(http.aclose())
        deadline = time.monotonic() + ABORT_WAIT_S
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    return {"out": "".join(written), "aborted": len(engine.aborted),
            "prompts": [bytes(p).decode() for p in engine.prompts]}


if __name__ == "__main__":
    print(json.dumps({"reply_or_interrupt": reply_or_interrupt, "chat": chat}[sys.argv[1]]()))
